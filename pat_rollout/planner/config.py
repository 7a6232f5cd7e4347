"""The planner's configuration (planner.policy.Planner reads it). Pure stdlib."""

from __future__ import annotations

from dataclasses import dataclass, field

from pat_rollout.planner.lookahead import LookaheadConfig
from pat_rollout.planner.margin import MarginConfig
from pat_rollout.planner.predictor import PredictorConfig

ESTIMATORS = ("drain", "lookahead", "auto")


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannerConfig:
    """- candidate_tps: TP sizes the planner may switch to.
    - eval_every_steps: evaluate at most once per this many decode steps (k).
    - min_gain_s / min_gain_ratio: switch only if saving - overhead > max(min_gain_s, ratio * remaining), the ratio
      min_gain_ratio until the estimate's error is measured, then set from it (`margin`, planner/margin.py).
    - min_steps_between_switches: no switch within this many steps of the previous one.
    - only_grow: only switch to a larger TP (the batch only drains during a stage).
    - no_return_steps: never switch back to a TP that was left less than this many steps ago.
    - max_reconfigs_per_stage: hard cap on switches per stage.
    - start_layout: choose each stage's starting TP from its batch (else the stage starts where the pool is).
    - explore_max_ratio: at a stage start, try a candidate TP never measured on this pool when its predicted stage
      time is within this factor of the best (the profile may be wrong about it); 0 never explores.
    - calibrate / calibration_alpha: correct the profile from measured polls and switches (EWMA weight).
    - rebalance: also consider moving requests between the current replicas (where the pool can).
    - max_rebalances_per_stage: hard cap on rebalances per stage; min_steps_between_switches also spaces
      rebalances from any earlier action.
    - estimator: how actions are scored (planner/policy.py): "drain" (closed form, no KV room), "lookahead"
      (tuned by `lookahead`), or "auto" (default): the lookahead where the batch's predicted KV peak exceeds some
      candidate layout's room (`Planner.capacity_bound`: admission queue, preemption and re-prefill are then
      what decides), the drain estimate where it fits every layout (there it chose well and costs least); see
      docs/planner_results.md for the rows each wins.
    - auto_lookahead_mid_stage: under "auto", also score a running stage by the lookahead while its layout is
      capacity-bound (off: measured worse, its drawn tails grow too early; the drain estimate then scores it,
      with no shrink and no move into a layout the batch outgrows).
    - lookahead_every_steps: under "auto", after an evaluation that needed the lookahead, the next waits this
      many steps (a capacity-bound stage changes slowly; the lookahead costs ~10-100x the drain estimate)."""

    candidate_tps: tuple[int, ...]
    eval_every_steps: int = 64
    min_gain_s: float = 0.5
    min_gain_ratio: float = 0.05
    min_steps_between_switches: int = 256
    only_grow: bool = False
    no_return_steps: int = 4096
    max_reconfigs_per_stage: int = 3
    start_layout: bool = True
    explore_max_ratio: float = 2.0
    calibrate: bool = True
    calibration_alpha: float = 0.5
    rebalance: bool = True
    max_rebalances_per_stage: int = 2
    predictor: PredictorConfig = field(default_factory=PredictorConfig)
    lookahead: LookaheadConfig = field(default_factory=LookaheadConfig)
    margin: MarginConfig = field(default_factory=MarginConfig)
    estimator: str = "auto"
    lookahead_every_steps: int = 256
    auto_lookahead_mid_stage: bool = False

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator={self.estimator!r} must be one of {ESTIMATORS}")
        if not self.candidate_tps or any(tp < 1 for tp in self.candidate_tps):
            raise ValueError(f"candidate_tps={self.candidate_tps} must be a non-empty tuple of positive ints")
        if len(set(self.candidate_tps)) != len(self.candidate_tps):
            raise ValueError(f"candidate_tps={self.candidate_tps} has duplicates")
        for name in ("eval_every_steps", "lookahead_every_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("min_gain_s", "min_gain_ratio", "min_steps_between_switches", "no_return_steps",
                     "max_reconfigs_per_stage", "explore_max_ratio", "max_rebalances_per_stage"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
