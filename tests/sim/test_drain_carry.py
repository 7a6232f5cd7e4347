"""The replica's drain carried across polls (planner/engine_model.py `_drain_chunks`: its totals kept while only
the clock moved) is a cache: a stage gives bit-identical results with it and with the totals rebuilt at every call."""

from __future__ import annotations

import pytest

from pat_rollout.planner.engine_model import EngineReplica
from pat_rollout.sim.compare import gpu_setup
from pat_rollout.sim.policies import StaticPolicy, run_policy
from pat_rollout.sim.traces import deepscaler_like


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_carried_drain_is_bit_identical(tp: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # 0.35 of an H100: TP1 preempts and re-prefills, the reserve throttles admission; requests queue at every TP
    hw, _ = gpu_setup("h100", "llama31_8b", "central", mem_fraction=0.35)
    trace = deepscaler_like(num_prompts=48, samples_per_prompt=8, max_new_tokens=8192, seed=0)
    calls = {"carried": 0}
    carried = EngineReplica._carried

    def counted(self: EngineReplica) -> bool:
        out = carried(self)
        calls["carried"] += out
        return out

    monkeypatch.setattr(EngineReplica, "_carried", counted)
    fast = run_policy(hw, trace, StaticPolicy(tp), num_devices=8)
    assert calls["carried"] > 0  # the carry was used
    monkeypatch.setattr(EngineReplica, "_carried", lambda self: False)
    fresh = run_policy(hw, trace, StaticPolicy(tp), num_devices=8)
    assert fast.latency_s == fresh.latency_s and fast.finish_times == fresh.finish_times
    assert (fast.schedule, fast.num_preempted, fast.prefill_tokens) == (
        fresh.schedule, fresh.num_preempted, fresh.prefill_tokens)


def test_clone_leaves_the_source_its_carry() -> None:
    """`Sim.clone` (the oracles branch at every poll) gives the copy no carried totals and leaves the source's: the
    source goes on from its cache, and both finish as an uncloned run does."""
    from pat_rollout.sim.simulator import Sim

    hw, _ = gpu_setup("h100", "llama31_8b", "central", mem_fraction=0.35)
    trace = deepscaler_like(num_prompts=16, samples_per_prompt=8, max_new_tokens=8192, seed=0)
    sim = Sim(hw, trace, num_devices=8, policy=StaticPolicy(2)).run(stop=lambda s: s.step >= 40)
    carries = [rep._carry for rep in sim.replicas]
    assert any(c is not None for c in carries)  # a drain ran and left its totals
    branch = sim.clone()
    assert all(rep._carry is c for rep, c in zip(sim.replicas, carries))  # the source's own objects
    assert all(rep._carry is None for rep in branch.replicas)
    ref = run_policy(hw, trace, StaticPolicy(2), num_devices=8)
    for run in (sim.run(), branch.run()):
        out = run.result("static")
        assert out.finish_times == ref.finish_times and out.latency_s == ref.latency_s
