"""torchao's Float8Linear, fed a contiguous input, as a class of its own module.

With row-wise scales torchao cannot reshape a non-contiguous [.., K] input (its `clone` has no
axiswise-scaled form), which a Linear after a transpose (a conv, an attention output) hands it.
The class lives at a module's top level, so that `torch.save(model)` can pickle the layers it
swapped in; the module imports torchao and is itself imported only when a float8 training recipe
swaps a layer.
"""

from __future__ import annotations

import torch
from torchao.float8.float8_linear import Float8Linear


class ContiguousInputFloat8Linear(Float8Linear):
    """`Float8Linear` whose forward makes its input contiguous first."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input.contiguous())
