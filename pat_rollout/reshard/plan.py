"""Pure weight-reshard plans (stdlib + pat_rollout only). The implementation lives in
`pat_rollout.layout.transition`, next to `plan_layout`; this module is the `reshard/` entry point."""

from __future__ import annotations

from pat_rollout.layout.transition import (
    PlanCache,
    WeightPlan,
    WeightTransfer,
    bytes_moved,
    check_specs_tp,
    plan_layout,
    plan_weights,
    spec_hash,
)

__all__ = ["PlanCache", "WeightPlan", "WeightTransfer", "bytes_moved", "check_specs_tp", "plan_layout",
           "plan_weights", "spec_hash"]
