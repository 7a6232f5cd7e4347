"""Rollout layouts and shard maps: which devices form which TP groups, which slice of every
parameter and KV head each rank holds, and how to move between layouts.

Pure Python: imports only the stdlib and pat_rollout.types (no torch, ray or sglang).
"""

from pat_rollout.layout.layout import Layout
from pat_rollout.layout.shard import Partition, ShardSpec, kv_heads_for_rank, model_shard_specs, shard_intervals
from pat_rollout.layout.transition import PlanCache, WeightPlan, WeightTransfer, bytes_moved, plan_layout, plan_weights

__all__ = ["Layout", "Partition", "PlanCache", "ShardSpec", "WeightPlan", "WeightTransfer", "bytes_moved",
           "kv_heads_for_rank", "model_shard_specs", "plan_layout", "plan_weights", "shard_intervals"]
