"""CUDA graphs on the capture-safe regions of each graph, from one shared pool.

- `capture_safety` which ops a CUDA graph cannot record, and why, in words with the fix
- `regions`        the graph's ops as maximal capture-safe regions without cycles
- `recorder`       recording region functions into the shared pool (`CudaGraphRecorder`)
- `replay`         replaying them safely: signatures, inputs read in place or copied in
- `pool_outputs`   the outputs replays handed out in the pool, moved out of a replay's way
- `transform`      `CudaGraphs`: plan, split, record, report
"""

from xform.transforms.cudagraphs.transform import CudaGraphs

__all__ = ["CudaGraphs"]
