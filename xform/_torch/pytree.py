"""torch's pytree utilities (`torch.utils._pytree`; torch has no public module for them yet)."""

from torch.utils._pytree import tree_flatten, tree_leaves, tree_map

__all__ = ["tree_flatten", "tree_leaves", "tree_map"]
