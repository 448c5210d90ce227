"""Linear layers to float8 and MX formats through torchao.

- `recipes`     each recipe's torchao config, limits, device needs and Inductor settings
- `probe`       whether torch's blockwise float8 GEMM is right on this device
- `float8_linear` torchao's Float8Linear fed a contiguous input (a picklable class)
- `split_amax`  an Inductor pass: the gradients' row and column amaxes reduced in two stages
- `transform`   `Quantize`: weights or modules swapped, the graph and guards to match
"""

from xform.transforms.quantize.recipes import RECIPES, QuantizeUnsupported
from xform.transforms.quantize.transform import Quantize

__all__ = ["Quantize", "QuantizeUnsupported", "RECIPES"]
