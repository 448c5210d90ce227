"""Data-parallel, sharded and tensor-parallel training from a single-device model.

- `sharding`      `ShardSpec`, `ShardedParameter`: a parameter held as this rank's cut
- `tp_shardings`  the tensor-parallel analysis' vocabulary: shardings, the plan, refusals
- `tp_rules`      how a sharded activation goes through each op
- `tp_plan`       which Linear pairs to cut, by following shardings through the graph
- `tp_rewrite`    applying that plan: cut weights, Megatron's f/g collectives, local sizes
- `transform`     `Distribute`
"""

from xform.transforms.distribute.sharding import ShardedParameter
from xform.transforms.distribute.transform import Distribute

__all__ = ["Distribute", "ShardedParameter"]
