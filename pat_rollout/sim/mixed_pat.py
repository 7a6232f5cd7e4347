"""Mixed PAT in the simulator (issue #26): planner.mixed.MixedPlanner driving a MixedSim, as PlannerPolicy drives
the uniform planner (the same stage start, calibration feed and length history; the planner sees progress only,
never true lengths). Pure stdlib."""

from __future__ import annotations

from pat_rollout.kv.cost import HandoffCost
from pat_rollout.planner.mixed import BuddyDecision, MixedPlanner
from pat_rollout.planner.policy import Planner
from pat_rollout.sim.buddy import Merge, MixedPollView, MixedResult, MixedSim, Split
from pat_rollout.sim.hardware import SimHardware
from pat_rollout.sim.policies import PlannerPolicy
from pat_rollout.sim.simulator import Rebalance, Reconfigure
from pat_rollout.sim.traces import Trace


class MixedPlannerPolicy(PlannerPolicy):
    """PlannerPolicy whose decisions come from a MixedPlanner over the planner: a BuddyDecision becomes a `Merge`
    or `Split`, the planner's own Decision a `Reconfigure` or `Rebalance`."""

    def __init__(self, planner: Planner, initial_tp: int, history: Trace | None = None, name: str = "mixed-pat", *,
                 can_rebalance: bool = False) -> None:
        super().__init__(planner, initial_tp, history, name, can_rebalance=can_rebalance)
        self.mixed = MixedPlanner(planner)

    def on_poll(self, view: MixedPollView) -> Merge | Split | Reconfigure | Rebalance | None:  # type: ignore[override]
        self.observe(view)
        d = self.mixed.decide(view.mixed_state)
        if isinstance(d, BuddyDecision):
            if d.action == "merge":
                return Merge(start=d.start, size=d.size, pull=d.pull, push=d.push, decision=d)
            return Split(start=d.start, size=d.size, decision=d)
        if d is not None and d.is_rebalance:
            return Rebalance(moves=d.moves, decision=d)
        return None if d is None else Reconfigure(tp=d.target_tp, decision=d)


def run_mixed_pat(hw: SimHardware, trace: Trace, planner: Planner, *, num_devices: int, initial_tp: int = 1,
                  handoff: HandoffCost | None = None, name: str = "mixed-pat") -> MixedResult:
    """One stage of mixed PAT on `trace` (its history seeds the predictor, as PlannerPolicy's does)."""
    policy = MixedPlannerPolicy(planner, initial_tp, trace, name=name)
    return MixedSim(hw, trace, num_devices=num_devices, policy=policy, handoff=handoff).run().result(name)
