"""SDPA and hand-written attention rewritten to flex_attention.

- `match`          the attention sites a graph computes, their masks and biases
- `index_mods`     a mask or bias subgraph as a function of the position (b, h, q, kv)
- `block_bounds`   what such a function can be on whole blocks of positions
- `mods`           mask_mod and score_mod, the flex_attention call, the mask in words
- `block_masks`    building the BlockMask once, before the call, or in the graph
- `reused_inputs`  a computation of graph inputs redone only when they changed
- `refusals`       why a site is left as written, and why Flash cannot run it
- `transform`      `FlexAttention`
"""

from xform.transforms.attention.block_masks import BLOCK, BlockMaskBuild
from xform.transforms.attention.refusals import flash_import_error
from xform.transforms.attention.transform import FlexAttention

__all__ = ["BLOCK", "BlockMaskBuild", "FlexAttention", "flash_import_error"]
