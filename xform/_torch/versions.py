"""What differs between the torch versions xform supports (2.11 to 2.14), one flag each.

Code elsewhere branches on these names, never on `torch.__version__`. Differences handled
without a branch are noted where they are handled: Dynamo's `symbolic_convert.tls.current_tx`
is deleted outside tracing by torch 2.13 and left None by 2.11 (`dynamo.DynamoFrame.current`).
"""

from __future__ import annotations

import torch
import torch._guards

# torch >= 2.13 repoints any storage (`UntypedStorage._swap_data_ptr_`); 2.11-2.12 moves only allocator-owned ones
STORAGE_SWAPS_DATA_PTR = hasattr(torch.UntypedStorage, "_swap_data_ptr_")

# torch >= 2.13: Dynamo's GuardsSet also indexes guards by source and has `clear()`; 2.11-2.12: an OrderedSet
GUARDS_SET_CLEARS = hasattr(torch._guards.GuardsSet, "clear")

# torch >= 2.13: Inductor's CPU flex kernel lowers a mask_mod reading a data tensor; 2.11: NoValidChoicesError
CPU_FLEX_LOWERS_DATA_MASKS = torch.__version__ >= (2, 13)
