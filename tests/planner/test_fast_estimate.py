"""The planner's fast paths (the drain estimate's cached step-time rows, predictions memoised per state, polls not
due skipped before the ClusterState is built) give the slow path's answers exactly: the same seconds, bit for bit,
and the same Decisions on a simulated stage."""

from __future__ import annotations

import random

import pytest

from pat_rollout.kv.cost import handoff_cost
from pat_rollout.planner import estimator
from pat_rollout.planner.calibration import Calibration, PollSample
from pat_rollout.planner.estimator import replica_drain_s, slow_replica_drain_s
from pat_rollout.planner.policy import Planner, PlannerConfig
from pat_rollout.profile.model import LatencyModel
from pat_rollout.sim.compare import engine_spec, gpu_setup, pat_hardware
from pat_rollout.sim.policies import PlannerPolicy, run_policy
from pat_rollout.sim.traces import deepscaler_like, rl_stages


def _calibrated(base: LatencyModel) -> LatencyModel:
    cal = Calibration()
    cal.observe_poll(base, PollSample(tp=1, replicas=((40.0, 900.0),), num_steps=8, elapsed_s=0.5))
    cal.observe_poll(base, PollSample(tp=2, replicas=((3.0, 5000.0), (2.0, 4000.0)), num_steps=8, elapsed_s=0.2))
    model = cal.model(base)
    assert type(model) is not LatencyModel  # a CalibratedModel: the factor path is exercised
    return model


@pytest.mark.parametrize("calibrated", [False, True])
def test_replica_drain_fast_equals_slow(calibrated: bool) -> None:
    base = LatencyModel.from_json("h100_llama31_8b")
    model = _calibrated(base) if calibrated else base
    rng = random.Random(3)
    for trial in range(40):
        n = rng.randint(1, 300)
        remaining = [rng.randint(1, 3000 if trial % 2 else 20000) for _ in range(n)]
        tokens = [rng.randint(0 if trial % 3 == 0 else 50, 30000) for _ in range(n)]
        for tp in (1, 2, 4, 8):
            fast = replica_drain_s(model, tp, remaining, tokens)
            slow = slow_replica_drain_s(model, tp, remaining, tokens)
            assert fast == slow, (trial, tp, fast, slow)
    assert estimator._step_table(model, 1) is not None  # the fast path ran, not the fallback


def _decisions(monkeypatch: pytest.MonkeyPatch | None) -> list[tuple]:
    hw, pm = gpu_setup("h100", "llama31_8b", "low")
    pool = pat_hardware(hw)
    trace = deepscaler_like(num_prompts=24, samples_per_prompt=8, max_new_tokens=8192, seed=1, history_iters=2)
    planner = Planner(pm, PlannerConfig(candidate_tps=(1, 2, 4, 8)), engine=engine_spec(pool))
    out: list[tuple] = []
    if monkeypatch is not None:  # the slow path: every chunk through decode_step_s, no memo, every poll decided
        monkeypatch.setattr(estimator, "_step_table", lambda model, tp: None)
        monkeypatch.setattr(Planner, "idle", lambda self, step: False)
        orig = Planner.predict_remaining

        def unmemoised(self: Planner, state):  # type: ignore[no-untyped-def]
            self._pred_memo = None
            return orig(self, state)
        monkeypatch.setattr(Planner, "predict_remaining", unmemoised)
    decide = Planner.decide

    def recording(self: Planner, state):  # type: ignore[no-untyped-def]
        d = decide(self, state)
        if self._last_eval_step == state.step:
            out.append(("eval", state.step, tuple((o.tp, o.remaining_s, o.cost.total_s, o.allowed)
                                                  for o in self.last_options)))
        if d is not None:
            out.append(("decision", d.step, d.source_tp, d.target_tp, d.predicted_remaining_now_s,
                        d.predicted_remaining_target_s, d.predicted_overhead_s))
        return d

    where = 1
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Planner, "decide", recording)
        for i, stage in enumerate(rl_stages(trace, 2)):
            r = run_policy(pool, stage, PlannerPolicy(planner, where, stage if i == 0 else None), num_devices=8,
                           handoff=handoff_cost(pm))
            out.append(("stage", i, r.latency_s, r.layouts_str()))
            where = planner.next_start_tp() or 1
    return out


def test_planner_fast_path_same_decisions(monkeypatch: pytest.MonkeyPatch) -> None:
    fast = _decisions(None)
    slow = _decisions(monkeypatch)
    assert sum(1 for x in fast if x[0] == "eval") > 10  # the planner evaluated many polls
    assert any(x[0] == "decision" for x in fast)
    assert fast == slow


def test_later_stages_start_where_the_weights_landed() -> None:
    """The layout the weights land in (next_start_tp) and the stage's start layout are one decision: a later stage
    switches at 0 s only for a predicted saving (never to explore: exploring is done by landing there), and a
    stage that lands in a layout to explore it does not leave it at 0 s. Before, the weights landed in the layout
    the previous stage explored and the stage explored another by a switch at 0 s (TP4@0 -> TP8@0 -> TP4@5s)."""
    hw, pm = gpu_setup("h100", "llama31_8b", "low")
    pool = pat_hardware(hw)
    trace = deepscaler_like(num_prompts=32, samples_per_prompt=8, max_new_tokens=8192, seed=1, history_iters=3)
    planner = Planner(pm, PlannerConfig(candidate_tps=(1, 2, 4, 8)), engine=engine_spec(pool))
    where, explored = 1, 0
    for i, stage in enumerate(rl_stages(trace, 3)):
        r = run_policy(pool, stage, PlannerPolicy(planner, where, stage if i == 0 else None), num_devices=8,
                       handoff=handoff_cost(pm))
        assert r.schedule[0] == (0.0, where)
        d = planner.start_decision
        if i > 0 and d is not None:
            assert "exploring" not in d.reason and d.predicted_saving_s > 0, (i, r.layouts_str(), d.reason)
        if i > 0:
            starts = [tp for t, tp in r.schedule if t == 0.0]
            explored += planner.start_explored
            assert len(starts) == 1 or d is not None, r.layouts_str()
        where = planner.next_start_tp() or 1
    assert explored  # this row explores a layout never measured (TP8) in a later stage: by landing there
