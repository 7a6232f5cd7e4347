"""The switch margin set from the estimate's measured error (issue #24 item 3)."""

from __future__ import annotations

import pytest

from pat_rollout.planner import ClusterState, Planner, PlannerConfig, ReqProgress
from pat_rollout.planner.margin import MarginConfig, MarginTracker
from pat_rollout.profile.model import LatencyModel
from pat_rollout.sim.compare import engine_spec, gpu_setup
from pat_rollout.sim.policies import PlannerPolicy, run_policy
from pat_rollout.sim.traces import deepscaler_like


def test_margin_is_the_default_until_a_stage_is_scored_then_the_measured_error() -> None:
    m = MarginTracker(MarginConfig(), default_ratio=0.05)
    assert m.ratio == 0.05 and m.end_stage() is None  # nothing seen: nothing scored
    m.predict(0, 1200, new_action=True)  # predicted 1200 steps to go, 1000 came: 20% long
    m.predict(500, 1100, new_action=False)  # 600 predicted, 500 came: 20% long
    m.seen(1000)
    assert m.end_stage() == pytest.approx(0.2)
    assert m.ratio == pytest.approx(min(0.2, MarginConfig().max_ratio))
    # an exact stage pulls the EWMA down (alpha 0.5), never below min_ratio
    m.predict(0, 1000, new_action=True)
    m.seen(1000)
    assert m.end_stage() == 0.0 and m.error == pytest.approx(0.1) and m.ratio == pytest.approx(0.1)
    for _ in range(20):
        m.predict(0, 1000, new_action=True)
        m.seen(1000)
        m.end_stage()
    assert m.ratio == MarginConfig().min_ratio


def test_only_predictions_of_the_path_taken_are_scored_and_step_time_error_adds() -> None:
    m = MarginTracker(MarginConfig(), default_ratio=0.05)
    m.predict(0, 5000, new_action=True)  # staying would have ended at 5000: a path not taken
    m.predict(200, 1100, new_action=True)  # the switch at 200: 900 predicted, 800 came
    m.predict(990, 1500, new_action=False)  # 10 steps before the end: too close to score
    m.seen(1000)
    assert m.end_stage(step_time_error=0.05) == pytest.approx(900 / 800 - 1 + 0.05)
    off = MarginTracker(MarginConfig(adaptive=False), default_ratio=0.05)
    off.predict(0, 2000, new_action=True)
    off.seen(1000)
    off.end_stage()
    assert off.error == pytest.approx(1.0) and off.ratio == 0.05


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="min_ratio"):
        MarginConfig(min_ratio=0.2, max_ratio=0.1)


def _batch(tp: int) -> ClusterState:
    reqs = tuple(ReqProgress(request_id=f"r{i}", prompt_key="p", num_prompt_tokens=200, num_output_tokens=0,
                             max_new_tokens=16384) for i in range(1024))
    return ClusterState(step=0, num_devices=8, tp=tp, requests=reqs)


def test_the_start_layout_uses_the_measured_margin() -> None:
    """A switch worth taking at the default 5% is refused once the estimate has proven off by more than it saves."""
    model = LatencyModel.from_json("h100_llama31_8b")
    cfg = PlannerConfig(candidate_tps=(1, 2, 4, 8), estimator="lookahead", margin=MarginConfig(max_ratio=0.9))
    p = Planner(model, cfg)
    for _ in range(8):
        p.observe_history("p", 1000)
    d = p.choose_start(_batch(4))
    assert d is not None and d.target_tp == 8  # the prior's tail up to the 16k cap: TP8 drains it fastest
    saving = 1.0 - d.predicted_remaining_target_s / d.predicted_remaining_now_s
    p.start_stage()
    p.margin.error = saving + 0.05  # measured: the estimate is off by more than the predicted saving
    assert p.margin.ratio > saving
    assert p.choose_start(_batch(4)) is None


def test_a_carried_planner_scores_its_lookahead_on_the_simulator_and_sets_its_margin() -> None:
    hw, model = gpu_setup("h100", "llama31_8b", "central")
    trace = deepscaler_like(num_prompts=16, max_new_tokens=4096, seed=3)
    p = Planner(model, PlannerConfig(candidate_tps=(1, 2, 4, 8), estimator="lookahead"), engine=engine_spec(hw))
    run_policy(hw, trace, PlannerPolicy(p, 1, trace), num_devices=8)
    assert p.margin.error is None and p.margin.ratio == 0.05  # not scored until the stage is over
    run_policy(hw, trace, PlannerPolicy(p, 1), num_devices=8)  # the next RL step scores the first
    assert len(p.margin.stage_errors) == 1
    err = p.margin.stage_errors[0]
    assert 0.0 < err < 0.3  # the lookahead on the planner's central profile: close, not exact
    assert p.margin.ratio == pytest.approx(min(max(err, 0.01), 0.15))
