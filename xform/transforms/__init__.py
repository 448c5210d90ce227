"""Built-in transforms, one module each. Importing this package registers their spec names."""

from xform.transforms.attention import FlexAttention
from xform.transforms.cast import Cast, LowPrecisionWeight
from xform.transforms.cudagraphs import CudaGraphs
from xform.transforms.distribute import Distribute, ShardedParameter
from xform.transforms.quantize import RECIPES, Quantize, QuantizeUnsupported

__all__ = ["CudaGraphs", "Distribute", "ShardedParameter", "FlexAttention", "Cast", "LowPrecisionWeight", "Quantize", "QuantizeUnsupported", "RECIPES"]
