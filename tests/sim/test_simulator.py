"""The simulator: admission, preemption with re-prefill, prefix sharing, reconfiguration, oracle bounds and the
planner's view (never the true lengths)."""

from __future__ import annotations

import pytest
from profile_helpers import linear_profile

from pat_rollout.planner import Planner, PlannerConfig
from pat_rollout.profile.model import LatencyModel
from pat_rollout.sim import DriverModel, ReconfigModel, SchedulerModel, Sim, SimHardware, Trace, TraceRecord
from pat_rollout.sim.compare import compare, gpu_setup
from pat_rollout.sim.policies import PlannerPolicy, ScheduledPolicy, StaticPolicy, run_policy
from pat_rollout.sim.replica import Replica, SimReq
from pat_rollout.sim.traces import deepscaler_like, verl_like


class Flat:
    """Step model: 1 s per decode step whatever the batch, 0.01 s per prefilled token."""

    def decode_step_s(self, tp: int, batch: float, context: float) -> float:
        return 1.0 / tp if batch > 0 else 0.0

    def prefill_s(self, tp: int, num_tokens: int) -> float:
        return 0.01 * num_tokens if num_tokens > 0 else 0.0


def _hw(cap: int, kind: str = "ref", block_size: int = 16, lockstep: bool = True, steps_per_poll: int = 1,
        reconfig: ReconfigModel | None = None) -> SimHardware:
    return SimHardware(name="test", step=Flat(), param_bytes=1000, kv_bytes_per_token=10,
                       kv_tokens={1: cap, 2: cap * 2}, scheduler=SchedulerModel(kind=kind, block_size=block_size),
                       driver=DriverModel(lockstep=lockstep, steps_per_poll=steps_per_poll, poll_interval_s=1.0),
                       reconfig=reconfig or ReconfigModel())


def _req(rid: str, plen: int, length: int, key: str | None = None, max_new: int = 1000) -> SimReq:
    return SimReq(rid=rid, prompt_key=key or rid, prompt_len=plen, length=length, max_new=max_new)


def test_ref_preempts_newest_and_reprefills_prompt_plus_generated() -> None:
    rep = Replica(_hw(64), tp=1)  # 4 blocks of 16 tokens
    a, b = _req("a", 16, 40), _req("b", 16, 40)
    rep.waiting.extend([a, b])
    rep.run(1000)
    # at 33 tokens each needs a third block: b (newest) is preempted with 17 tokens generated, re-prefills
    # 16 + 17 = 33 tokens after a finishes (a alone needs all 4 blocks at 49+ tokens)
    assert rep.num_preempted == 1
    assert rep.prefill_tokens == 16 + 16 + 33
    assert [r.rid for _, r in rep.finished] == ["a", "b"]
    assert rep.used == 0 and not rep.busy
    t_a, t_b = (t for t, _ in rep.finished)
    assert t_a == pytest.approx(40 * 1.0 + 0.32)  # 40 steps + prefill of both prompts in step 1
    assert t_b == pytest.approx(t_a + 0.33 + (40 - 17) * 1.0)  # re-prefill, then its remaining 23 tokens


def test_sglang_reserve_holds_back_admission_and_prefix_is_shared() -> None:
    rep = Replica(_hw(1000, kind="sglang", block_size=1), tp=1)
    rep.waiting.extend([_req("a", 100, 5, max_new=1000), _req("b", 100, 5, max_new=1000)])
    rep.run(1)
    # a: 100 + 0.7 * 1000 <= 1000 admitted; b: 200 + 0.7 * 2000 > 1000 waits
    assert [r.rid for r in rep.running] == ["a"] and [r.rid for r in rep.waiting] == ["b"]
    shared = Replica(_hw(10_000, kind="sglang", block_size=1), tp=1)
    shared.waiting.extend([_req("a", 100, 50, key="p"), _req("b", 100, 50, key="p")])
    shared.run(1)
    assert len(shared.running) == 2
    assert shared.prefill_tokens == 100  # one prefill of the shared prompt
    assert shared.used == 100 + 0 + 0  # prompt once; each holds 0 own tokens before its first KV write


def test_reconfigure_charges_phases_and_every_request_finishes() -> None:
    rc = ReconfigModel(fixed_s=0.5, reshard_fixed_s=0.25, switch_s=0.25)
    hw = _hw(10_000, reconfig=rc)
    trace = Trace(name="t", records=tuple(TraceRecord(prompt_id=f"p{i}", prompt_len=10, response_len=n)
                                          for i, n in enumerate((5, 5, 5, 30))), max_new_tokens=30)
    static = run_policy(hw, trace, StaticPolicy(1), num_devices=2)
    sched = run_policy(hw, trace, ScheduledPolicy(tp0=1, switches=((1, 2),)), num_devices=2)
    assert sched.schedule[1][1] == 2 and sched.overhead_s == pytest.approx(1.0)
    assert len(sched.finish_times) == len(static.finish_times) == 4
    # after the switch the long request runs at 0.5 s/step but re-prefills its 10 + 5 tokens (no cost model)
    assert sched.prefill_tokens == 20 + 20 + 15
    assert sched.latency_s < static.latency_s


class Recorder(PlannerPolicy):
    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.seen: list[tuple] = []

    def on_poll(self, view):
        self.seen.append((view.state, view.finished))
        return super().on_poll(view)


def test_planner_never_sees_true_lengths() -> None:
    """Two stages that differ only in the longest response's length look the same to the planner for as long as
    that response runs in both."""
    hw, prof = gpu_setup("h100", "llama31_8b", "central")
    base = verl_like(num_prompts=16, samples_per_prompt=4, max_new_tokens=16384, seed=3)
    i = max(range(len(base.records)), key=lambda k: base.records[k].response_len)
    short = base.records[i].response_len
    longer = Trace(name="b", records=tuple(TraceRecord(prompt_id=r.prompt_id, prompt_len=r.prompt_len,
                                                       response_len=(16384 if k == i else r.response_len))
                                           for k, r in enumerate(base.records)), max_new_tokens=16384,
                   history=base.history)
    assert short < 16384
    cfg = PlannerConfig(candidate_tps=(1, 2, 4, 8))
    seen = []
    for trace in (base, longer):
        pol = Recorder(Planner(prof, cfg), 1, trace)
        Sim(hw, trace, num_devices=8, policy=pol).run()
        seen.append(pol.seen)
    # the longest response finishes last: everything the planner saw of `base` it also saw of `longer`
    assert len(seen[0]) > 5 and len(seen[1]) > len(seen[0])
    assert seen[0] == seen[1][:len(seen[0])]


def test_oracle_bounds_static_and_pat_on_gpu_profile() -> None:
    hw, prof = gpu_setup("h100", "llama31_8b", "central")
    trace = deepscaler_like(num_prompts=16, samples_per_prompt=8, max_new_tokens=8192, seed=0)
    cmp = compare(hw, prof, trace, num_devices=8, planner_config=PlannerConfig(candidate_tps=(1, 2, 4, 8)))
    by = cmp.by()
    assert set(by) == {"static-tp1", "static-tp2", "static-tp4", "static-tp8", "pat", "oracle"}
    statics = [r for r in cmp.results if r.policy.startswith("static")]
    assert by["oracle"].latency_s <= min(r.latency_s for r in statics) + 1e-9  # its search starts from each static
    assert by["pat"].latency_s <= 1.02 * by["oracle"].latency_s


def test_capacity_bound_tp1_preempts_on_h100() -> None:
    hw, _ = gpu_setup("h100", "llama31_8b", "central")
    trace = deepscaler_like(num_prompts=128, samples_per_prompt=8, max_new_tokens=16384, seed=0)  # 1024 requests
    tp1 = run_policy(hw, trace, StaticPolicy(1), num_devices=8)
    tp8 = run_policy(hw, trace, StaticPolicy(8), num_devices=8)
    assert tp1.num_preempted > 0 and tp8.num_preempted == 0


def test_unknown_action_is_rejected() -> None:
    sim = Sim(_hw(1000), Trace(name="t", records=(TraceRecord(prompt_id="p", prompt_len=1, response_len=2),),
                               max_new_tokens=2), num_devices=2, policy=StaticPolicy(1))
    with pytest.raises(ValueError, match="unknown action 'x'; known \\['Batch', 'HindsightRebalance', 'Rebalance', 'Reconfigure'\\]"):
        sim.apply("x")


def test_latency_model_is_a_step_model() -> None:
    prof = LatencyModel.from_json("h100_llama31_8b")
    hw, _ = gpu_setup("h100", "llama31_8b", "central")
    assert prof.decode_step_s(2, 64, 1024) == pytest.approx(hw.step.decode_step_s(2, 64, 1024), rel=0.02)


def test_fitted_step_model_is_exact_on_its_form_and_ignores_one_bad_point() -> None:
    from pat_rollout.sim.hardware import FittedStepModel

    def law(b: int, c: int) -> float:
        return {1: 0.02, 4: 0.05, 16: 0.08}[b] + 1e-6 * b * c

    d = LatencyModel.from_json("cpu_ref_llama_demo").to_dict()
    d["decode"] = [{"tp": tp, "batch": b, "context": c, "step_s": law(b, c)}
                   for tp in (1, 2) for b in (1, 4, 16) for c in (16, 128, 320)]
    m = FittedStepModel.from_dict(d)
    assert m.decode_step_s(1, 4, 200) == pytest.approx(law(4, 200))
    assert m.decode_step_s(2, 10, 100) == pytest.approx(0.05 + 0.5 * 0.03 + 1e-6 * 10 * 100)
    d["decode"][0]["step_s"] = 0.5  # one cold, slow point at tp1 batch 1 context 16
    bad = FittedStepModel.from_dict(d)
    assert bad.decode_step_s(1, 1, 128) == pytest.approx(law(1, 128), rel=0.05)
    assert LatencyModel.from_dict(d).decode_step_s(1, 1, 128) == 0.5  # the envelope the planner reads


def test_export_some_requests_frees_only_their_kv() -> None:
    rep = Replica(_hw(10_000), tp=1)
    rep.waiting.extend([_req("a", 16, 40), _req("b", 16, 40), _req("c", 16, 40)])
    rep.run(3)
    used = rep.used
    out = rep.export({"b"})
    assert [r.rid for r in out] == ["b"] and out[0].cached and out[0].g == 3
    assert [r.rid for r in rep.running] == ["a", "c"] and rep.used == used - 32  # b held 2 blocks of 16
    assert rep.import_cached(out[0]) and rep.used == used


def test_planner_policy_picks_the_start_layout_and_calibrates_from_the_simulated_pool() -> None:
    from pat_rollout.sim.hardware import ref_cpu_hardware

    hw = ref_cpu_hardware(linear_profile(), tps=(1, 2), num_kv_blocks=1024, block_size=16, steps_per_poll=4)
    trace = Trace(name="t", records=tuple(TraceRecord(prompt_id=f"p{i}", prompt_len=16, response_len=300 if i == 0
                                                      else 20) for i in range(16)), max_new_tokens=300)
    planner = Planner(linear_profile(tp2_scale=3.0), PlannerConfig(
        candidate_tps=(1, 2), eval_every_steps=4, min_gain_s=0.0, min_steps_between_switches=8, explore_max_ratio=5.0))
    # stage 1, the pool in 1 x TP2: the (wrong) profile says 2 x TP1 for the whole stage; the start switch is timed
    first = run_policy(hw, trace, PlannerPolicy(planner, 1), num_devices=2, prev_tp=2)
    assert first.schedule == ((0.0, 2), (0.0, 1)) and first.decisions[0].reason.startswith("stage start")
    raw = planner._cost(planner.model, 2, 2, 1, []).total_s - planner.calibration.overhead_bias_s(2, 1)
    assert first.overhead_s > 0 and planner.calibration.overhead_bias_s(2, 1) == pytest.approx(first.overhead_s - raw)
    assert planner.calibration.observed_tps() == {1}
    assert planner.calibration.decode_factor(1, 8) == pytest.approx(1.0, rel=1e-6)  # TP1 was profiled right
    # stage 2: TP2 was never measured and is within explore_max_ratio: explored, measured, corrected (1/3)
    second = run_policy(hw, trace, PlannerPolicy(planner, 1), num_devices=2, prev_tp=first.schedule[-1][1])
    assert second.schedule[:2] == ((0.0, 1), (0.0, 2)) and "exploring" in second.decisions[0].reason
    assert planner.calibration.observed_tps() == {1, 2}
    assert planner.calibration.decode_factor(2, 1) == pytest.approx(1 / 3, rel=1e-6)


def test_poll_samples_leave_out_polls_that_prefilled_or_finished_a_request() -> None:
    from pat_rollout.planner.calibration import PollSample

    class Watch(StaticPolicy):
        def on_poll(self, view):
            self.seen.append((view.state.step, view.num_unfinished, view.samples))

    hw = _hw(10_000, steps_per_poll=1)
    trace = Trace(name="t", records=(TraceRecord(prompt_id="a", prompt_len=4, response_len=3),
                                     TraceRecord(prompt_id="b", prompt_len=4, response_len=6)), max_new_tokens=6)
    pol = Watch(2)
    pol.seen = []
    Sim(hw, trace, num_devices=2, policy=pol).run()
    by_step = {step: (left, samples) for step, left, samples in pol.seen}
    assert by_step[1][1] == ()  # the prefill poll
    (two,), (four,) = by_step[2][1], by_step[4][1]
    assert isinstance(two, PollSample) and isinstance(four, PollSample)
    assert (two.tp, two.replicas, two.num_steps, two.elapsed_s) == (2, ((2.0, 4 + 2 - 0.5),), 1, pytest.approx(0.5))
    assert by_step[3] == (1, ())  # request a finished in this poll
    assert (four.replicas, four.elapsed_s) == (((1.0, 4 + 4 - 0.5),), pytest.approx(0.5))
