"""torch.distributed's functional collectives (`funcol`): collectives that return tensors and
trace into FX graphs, which the distribute transform inserts."""

import torch.distributed._functional_collectives as funcol

__all__ = ["funcol"]
