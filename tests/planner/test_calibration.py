"""Online calibration and the stage's starting layout, on hand-made profiles whose truth is known: the profile's
errors, the measurements fed back, and the decisions they lead to (no timing)."""

from __future__ import annotations

import math

import pytest

from pat_rollout.planner import ClusterState, Planner, PlannerConfig, ReqProgress
from pat_rollout.planner.calibration import Calibration, PollSample, ReconfigSample, batch_bucket
from pat_rollout.planner.lookahead import LookaheadConfig
from pat_rollout.profile.model import LatencyModel

BATCHES = (1, 2, 4, 8, 16)


def truth_step_s(tp: int, batch: float) -> float:
    """The pool's real decode step (2 devices): TP2 is faster per replica but there is only one of it, so 2xTP1
    wins a full batch and 1xTP2 wins the tail."""
    return 0.010 + 0.004 * batch if tp == 1 else 0.006 + 0.003 * batch


def profile(tp2_scale: float = 1.0, switch_s: float = 1e-3) -> LatencyModel:
    """The truth as a profile, with TP2's steps scaled by `tp2_scale` (3 = a wrong profile: TP2 never wins)."""
    decode = [{"tp": tp, "batch": b, "context": c, "step_s": truth_step_s(tp, b) * (tp2_scale if tp == 2 else 1.0)}
              for tp in (1, 2) for b in BATCHES for c in (8, 1024)]
    return LatencyModel.from_dict({
        "schema_version": 1,
        "meta": {"hardware": "test", "model": "tiny", "backend": "reference", "source": "measured", "notes": "hand-made"},
        "model": {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
                  "param_bytes": 1000, "dtype_bytes": 8},
        "decode": decode,
        "prefill": [{"tp": tp, "tokens_per_s": 1e6, "fixed_s": 0.0} for tp in (1, 2)],
        "kv_transfer": {"bandwidth_bytes_per_s": 1e9, "latency_s": 1e-5},
        "reshard": {"bandwidth_bytes_per_s": 1e9, "fixed_s": 1e-4},
        "group_switch_s": switch_s,
    })


CFG = dict(candidate_tps=(1, 2), eval_every_steps=1, min_gain_s=0.0, min_steps_between_switches=0)


@pytest.fixture(autouse=True, params=["drain", "lookahead"])
def estimator(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test under both estimators: calibration corrects the profile whichever scores the actions."""
    monkeypatch.setitem(CFG, "estimator", request.param)
    if request.param == "lookahead":  # exact lengths: the predicted times below are exact
        monkeypatch.setitem(CFG, "lookahead", LookaheadConfig(length_grid=0.0))
    return request.param


def reqs(n: int, max_new: int, done: int = 0) -> tuple[ReqProgress, ...]:
    return tuple(ReqProgress(request_id=f"r{i}", prompt_key=None, num_prompt_tokens=16, num_output_tokens=done,
                             max_new_tokens=max_new) for i in range(n))


def tail(tp: int, step: int = 100) -> ClusterState:
    """One request left with ~300 tokens to go (the predictor's prior: half of what remains of 700)."""
    return ClusterState(step=step, num_devices=2, tp=tp, requests=reqs(1, 700, done=100))


def measured(tp: int, batch: float, steps: int = 4) -> PollSample:
    return PollSample(tp=tp, replicas=((batch, 100.0),), num_steps=steps, elapsed_s=steps * truth_step_s(tp, batch))


def test_wrong_profile_steers_until_recorded_steps_correct_it(estimator: str) -> None:
    p = Planner(profile(tp2_scale=3.0), PlannerConfig(**CFG))
    assert p.decide(tail(1, step=100)) is None  # the profile says TP2 is 3x slower than it is
    p.observe_poll(measured(1, 1))  # TP1 measured as profiled: changes nothing
    assert p.decide(tail(1, step=101)) is None
    for _ in range(2):
        p.observe_poll(measured(2, 1))  # a poll of this pool at TP2 (another stage's tail)
    d = p.decide(tail(1, step=102))
    assert d is not None and d.target_tp == 2
    # lookahead: after the regroup the request re-prefills its 16 + 100 tokens (1e6 tokens/s: recompute beats
    # migration) inside the remaining time; drain charges the hand-off to the switch's cost instead
    reprefill_s = 116 / 1e6 if estimator == "lookahead" else 0.0
    assert d.predicted_remaining_target_s == pytest.approx(300 * truth_step_s(2, 1) + reprefill_s, rel=1e-6)
    assert d.predicted_remaining_now_s == pytest.approx(300 * truth_step_s(1, 1), rel=1e-6)


def test_calibration_disabled_keeps_the_profile() -> None:
    p = Planner(profile(tp2_scale=3.0), PlannerConfig(**CFG, calibrate=False))
    for _ in range(3):
        p.observe_poll(measured(2, 1))
    assert p.decide(tail(1)) is None
    assert p.stage_metrics()["pat/profile_error"] == pytest.approx(2 / 3)  # the error is still reported


def test_factor_converges_within_a_few_polls_and_errors_are_reported() -> None:
    cal = Calibration()
    wrong = profile(tp2_scale=3.0)
    raw, cal_s = cal.observe_poll(wrong, measured(2, 4))
    assert raw == cal_s == pytest.approx(measured(2, 4).elapsed_s * 3)  # nothing measured yet: the profile
    assert cal.decode_factor(2, 4) == pytest.approx(1 / 3)
    _, cal_s = cal.observe_poll(wrong, measured(2, 4))
    assert cal_s == pytest.approx(measured(2, 4).elapsed_s)  # the second poll is predicted right
    m = cal.metrics()
    assert m["pat/calibration_polls"] == 2 and m["pat/profile_error"] == pytest.approx(2 / 3)
    assert m["pat/calibrated_error"] == pytest.approx(1 / 3)  # (2/3 + 0) / 2
    assert m["pat/decode_factor_tp2"] == pytest.approx(1 / 3)
    cal.start_stage()
    assert "pat/profile_error" not in cal.metrics() and cal.decode_factor(2, 4) == pytest.approx(1 / 3)


def test_factor_lookup_nearest_bucket_then_other_tps_then_one() -> None:
    cal = Calibration()
    m = profile()
    assert cal.decode_factor(1, 1) == 1.0 and cal.model(m) is m
    cal.observe_poll(m, PollSample(tp=1, replicas=((8, 10.0),), num_steps=1, elapsed_s=2 * truth_step_s(1, 8)))
    cal.observe_poll(m, PollSample(tp=2, replicas=((1, 10.0),), num_steps=1, elapsed_s=8 * truth_step_s(2, 1)))
    assert batch_bucket(1) == 0 and batch_bucket(3) == 1 and batch_bucket(8) == 3
    assert cal.decode_factor(1, 12) == pytest.approx(2.0)  # same bucket
    assert cal.decode_factor(1, 1) == pytest.approx(2.0)  # nearest bucket of the same TP
    assert cal.decode_factor(4, 1) == pytest.approx(4.0)  # unmeasured TP: geometric mean of TP1 (2x) and TP2 (8x)
    assert cal.model(m).decode_step_s(2, 1, 10) == pytest.approx(8 * truth_step_s(2, 1))
    assert cal.observed_tps() == {1, 2}


def test_overhead_bias_per_pair_borrowed_by_the_reverse_pair_and_reset_by_bind() -> None:
    m = profile(switch_s=0.01)
    p = Planner(m, PlannerConfig(**CFG))
    before = p._cost(m, 2, 1, 2, []).total_s
    p.observe_reconfig(ReconfigSample(num_devices=2, tp_src=1, tp_dst=2, num_tokens=(), elapsed_s=before + 0.5))
    assert p._cost(m, 2, 1, 2, []).total_s == pytest.approx(before + 0.5)
    assert p._cost(m, 2, 2, 1, []).total_s >= 0.5  # the reverse pair borrows the measured bias
    p.observe_reconfig(ReconfigSample(num_devices=2, tp_src=2, tp_dst=1, num_tokens=(), elapsed_s=0.0))
    assert p._cost(m, 2, 2, 1, []).total_s == pytest.approx(0.0, abs=1e-12)  # never below zero
    metrics = p.stage_metrics()
    assert metrics["pat/overhead_bias_tp1_tp2_s"] == pytest.approx(0.5)
    assert metrics["pat/overhead_error_s"] > 0
    assert p.calibration.bind(("model", 2, (1, 2))) is True
    assert p._cost(m, 2, 1, 2, []).total_s == pytest.approx(before)  # a new model/layout set forgets
    assert p.calibration.bind(("model", 2, (1, 2))) is False


def test_start_layout_follows_the_batch() -> None:
    p = Planner(profile(), PlannerConfig(**CFG))
    full = ClusterState(step=0, num_devices=2, tp=2, requests=reqs(16, 64))
    d = p.choose_start(full)
    assert d is not None and d.source_tp == 2 and d.target_tp == 1  # 2 x TP1 drain a full uniform batch faster
    assert p.choose_start(ClusterState(step=0, num_devices=2, tp=1, requests=reqs(16, 64))) is None
    few_long = ClusterState(step=0, num_devices=2, tp=1, requests=reqs(1, 600))
    d = p.choose_start(few_long)
    assert d is not None and d.target_tp == 2 and "stage start" in d.reason
    assert p.num_reconfigs == 0  # a stage-start switch is not a mid-stage switch for the hysteresis guards
    assert p.choose_start(ClusterState(step=0, num_devices=2, tp=2, requests=reqs(1, 600))) is None


def test_start_stays_within_the_margin_and_when_switching_costs_more() -> None:
    p = Planner(profile(switch_s=100.0), PlannerConfig(**CFG))
    assert p.choose_start(ClusterState(step=0, num_devices=2, tp=1, requests=reqs(1, 600))) is None
    p = Planner(profile(), PlannerConfig(**{**CFG, "min_gain_ratio": 0.9}))
    batch = ClusterState(step=0, num_devices=2, tp=1, requests=reqs(1, 600))
    first = p.choose_start(batch)  # the first stage: the base layout was no estimate's choice, the fastest wins
    assert first is not None and first.target_tp == 2 and p.next_start_tp() == 2
    p.start_stage()
    p.last_start_tp = 1  # a later stage, whose start (and weight load) was chosen in TP1: the margin keeps it
    assert p.choose_start(batch) is None


def test_start_explores_a_layout_the_profile_wrongly_rules_out_once() -> None:
    p = Planner(profile(tp2_scale=2.0), PlannerConfig(**CFG))
    batch = ClusterState(step=0, num_devices=2, tp=1, requests=reqs(1, 600))
    assert p.choose_start(batch) is None  # nothing measured yet: trust the profile (TP1)
    p.observe_poll(measured(1, 1))
    d = p.choose_start(batch)
    assert d is not None and d.target_tp == 2 and "exploring" in d.reason and p.start_explored
    p.observe_poll(measured(2, 1))  # now measured: the truth says TP2 wins the tail on its own merit
    p.start_stage()
    d = p.choose_start(batch)
    assert d is not None and d.target_tp == 2 and "exploring" not in d.reason and not p.start_explored
    no_explore = Planner(profile(tp2_scale=2.0), PlannerConfig(**CFG, explore_max_ratio=0.0))
    no_explore.observe_poll(measured(1, 1))
    assert no_explore.choose_start(batch) is None


def test_shrinks_within_a_stage_when_predicted_to_pay_unless_only_grow() -> None:
    state = ClusterState(step=50, num_devices=2, tp=2, requests=reqs(16, 400, done=10))
    d = Planner(profile(), PlannerConfig(**CFG)).decide(state)
    assert d is not None and d.source_tp == 2 and d.target_tp == 1
    assert Planner(profile(), PlannerConfig(**CFG, only_grow=True)).decide(state) is None


@pytest.mark.parametrize("kw, msg", [
    (dict(tp=1, replicas=(), num_steps=1, elapsed_s=1.0), "non-empty"),
    (dict(tp=1, replicas=((1, 1.0),), num_steps=0, elapsed_s=1.0), "num_steps=0"),
    (dict(tp=1, replicas=((0, 1.0),), num_steps=1, elapsed_s=1.0), "batch >= 1"),
])
def test_poll_sample_validation(kw, msg) -> None:
    with pytest.raises(ValueError, match=msg):
        PollSample(**kw)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="explore_max_ratio=-1"):
        PlannerConfig(candidate_tps=(1,), explore_max_ratio=-1)
    with pytest.raises(ValueError, match="alpha=0"):
        Planner(profile(), PlannerConfig(candidate_tps=(1,), calibration_alpha=0.0))
    assert math.isfinite(Calibration().decode_factor(1, 1))


def test_start_switch_spaces_the_next_one_but_the_stage_may_grow_back_to_where_the_pool_came_from() -> None:
    p = Planner(profile(), PlannerConfig(**{**CFG, "min_steps_between_switches": 16, "no_return_steps": 4096}))
    d = p.choose_start(ClusterState(step=100, num_devices=2, tp=2, requests=reqs(16, 64)))  # driver's step clock
    assert d is not None and d.target_tp == 1 and p.start_step == 100
    assert p.decide(tail(1, step=108)) is None
    assert "min_steps_between_switches=16" in p._why_not(tail(1, step=108), 2)
    d = p.decide(tail(1, step=116))  # the tail wants TP2 back: the layout the previous stage left is not "left"
    assert d is not None and d.target_tp == 2


def test_an_explored_start_layout_is_not_left_before_a_poll_in_it_was_measured() -> None:
    p = Planner(profile(tp2_scale=2.0), PlannerConfig(**CFG))
    p.observe_poll(measured(1, 1))
    d = p.choose_start(ClusterState(step=0, num_devices=2, tp=1, requests=reqs(1, 600)))
    assert d is not None and d.target_tp == 2 and p.start_explored
    full = ClusterState(step=10, num_devices=2, tp=2, requests=reqs(16, 400, done=10))  # profile: 2 x TP1 wins
    assert p.decide(full) is None and p._why_not(full, 1) == "exploring tp=2: no poll measured in it yet"
    p.observe_poll(measured(2, 16))
    d = p.decide(ClusterState(step=11, num_devices=2, tp=2, requests=reqs(16, 400, done=11)))
    assert d is not None and d.target_tp == 1  # measured now; the truth also says 2 x TP1 for a full batch


def test_a_shrink_must_pay_for_growing_back() -> None:
    state = ClusterState(step=50, num_devices=2, tp=2, requests=reqs(16, 400, done=10))
    now_s, (opt,) = Planner(profile(switch_s=0.0), PlannerConfig(**CFG)).evaluate(state)
    margin = PlannerConfig(candidate_tps=(1,)).min_gain_ratio * now_s  # min_gain_s is 0 in CFG
    saving = now_s - opt.remaining_s
    assert opt.tp == 1 and opt.return_s > 0
    lo = (saving - margin - opt.cost.total_s - opt.return_s) / 2  # switch_s above this: the round trip does not pay
    hi = saving - margin - opt.cost.total_s  # below this: the one-way shrink would
    assert 0 < lo < hi
    p = Planner(profile(switch_s=(lo + hi) / 2), PlannerConfig(**CFG))
    assert p.decide(state) is None
    (o,) = p.last_options
    assert o.remaining_s + o.cost.total_s < now_s - margin < o.total_s


def test_the_profile_memory_survives_calibration() -> None:
    """The lookahead's KV capacity comes from the profile's memory section: a calibrated profile keeps it."""
    from pat_rollout.planner.calibration import CalibratedModel
    from pat_rollout.planner.engine_spec import EngineSpec

    base = LatencyModel.from_json("h100_llama31_8b")
    assert base.memory
    cal = Calibration()
    cal.observe_poll(base, PollSample(tp=2, replicas=((64.0, 1000.0),), num_steps=8,
                                      elapsed_s=8 * 1.3 * base.decode_step_s(2, 64, 1004)))
    m = cal.model(base)
    assert isinstance(m, CalibratedModel) and m.decode_step_s(2, 64, 1004) == pytest.approx(
        1.3 * base.decode_step_s(2, 64, 1004))
    assert m.memory == base.memory
    assert EngineSpec.default_for(m, m.tps) == EngineSpec.default_for(base, base.tps)
