"""KV-cache hand-off for requests that change replica during a reconfiguration: the pure plan
(`kv.plan`: which heads move from which device), the pure migrate-vs-recompute cost model (`kv.cost`)
and the torch executor (`kv.apply`).

The package root re-exports only the pure modules; `kv.apply` (torch) is imported explicitly.
Must not import ray or sglang.
"""

from pat_rollout.kv.cost import HandoffCost, HandoffDecision, HandoffMethod, choose_handoff
from pat_rollout.kv.plan import KVMove, KVPlan, KVTransfer, plan_kv

__all__ = ["HandoffCost", "HandoffDecision", "HandoffMethod", "KVMove", "KVPlan", "KVTransfer", "choose_handoff",
           "plan_kv"]
