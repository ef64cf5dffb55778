"""Tensor and pipeline parallelism: what a layer needs to know to hold and combine its shard,
and how a model is cut across ranks.

group.py: TensorParallelGroup, which every TP-aware layer takes (SINGLE: world size 1,
every collective the identity). layout.py: which heads and layers a rank holds
(`kv_head_shard`, `layer_ranges`), and `check_parallel`, which refuses at startup a model
that cannot be cut.
"""

from infire.parallel.group import SINGLE, TensorParallelGroup
from infire.parallel.layout import check_parallel, kv_head_shard, layer_ranges

__all__ = [
    "SINGLE",
    "TensorParallelGroup",
    "check_parallel",
    "kv_head_shard",
    "layer_ranges",
]
