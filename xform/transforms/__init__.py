"""Built-in transforms, one home each. Importing this package registers their spec names.

- `cast`          Linear weights held and computed in bf16 / fp16
- `quantize/`     float8 and MX recipes through torchao
- `distribute/`   ddp, fsdp and tensor parallelism through torch.distributed
- `cudagraphs/`   CUDA graphs on the capture-safe regions, one shared pool
- `attention/`    SDPA and hand-written attention to flex_attention
- `linear_layers` what the transforms that change Linear layers share: the layers, `filter=`
"""

from xform.transforms.attention import FlexAttention
from xform.transforms.cast import Cast, LowPrecisionWeight
from xform.transforms.cudagraphs import CudaGraphs
from xform.transforms.distribute import Distribute, ShardedParameter
from xform.transforms.quantize import RECIPES, Quantize, QuantizeUnsupported

__all__ = ["Cast", "CudaGraphs", "Distribute", "FlexAttention", "LowPrecisionWeight", "Quantize", "QuantizeUnsupported",
           "RECIPES", "ShardedParameter"]
