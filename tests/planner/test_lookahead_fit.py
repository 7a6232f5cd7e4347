"""A request (or a lookahead unit) that does not fit a replica's KV alone (issue #24): the engine's mechanics
(planner/engine_model.py, one copy for the simulator and the lookahead) run it alone past the capacity instead of
raising; the lookahead, whose units of m requests get 1/m of the KV, scores such layouts instead of crashing."""

from __future__ import annotations

import pytest

from pat_rollout.planner import ClusterState, EngineSpec, Planner, PlannerConfig, ReqProgress
from pat_rollout.planner.engine_model import EngineReplica, EngineReq, SchedulerModel
from pat_rollout.profile.model import LatencyModel


class _Step:
    """1 ms per decode step, prefill free: a replica's time is its steps."""

    def decode_step_s(self, tp: int, batch: float, context: float) -> float:
        return 1e-3

    def prefill_s(self, tp: int, num_tokens: int) -> float:
        return 0.0


@pytest.mark.parametrize("kind", ["ref", "sglang"])
def test_a_request_larger_than_the_pool_runs_alone(kind: str) -> None:
    sched = SchedulerModel(kind=kind, block_size=1)
    rep = EngineReplica(_Step(), sched, cap=100, tp=1)
    # the first fits alone only at the start, the second never: each runs alone, in queue order, never preempted
    for i, (prompt, length) in enumerate([(50, 80), (120, 30), (10, 20)]):
        rep.waiting.append(EngineReq(rid=f"r{i}", prompt_key=f"p{i}", prompt_len=prompt, length=length,
                                     max_new=length))
    rep.run(1 << 30)
    assert [r.rid for _, r in rep.finished] == ["r0", "r1", "r2"]
    assert rep.num_preempted == 0 and not rep.busy and rep.used == 0
    assert rep.decode_tokens == rep.steps == 80 + 30 + 20  # one request per step: nothing ran beside another
    assert rep.t == pytest.approx(rep.steps * 1e-3)


def _requests(n: int) -> tuple[ReqProgress, ...]:
    return tuple(ReqProgress(request_id=f"r{i}", prompt_key=None, num_prompt_tokens=500, num_output_tokens=3000,
                             max_new_tokens=8000, replica=i % 8, cached=True) for i in range(n))


def test_lookahead_decides_when_a_unit_is_larger_than_its_share_of_kv() -> None:
    # 1024 requests of 3.5k tokens on TP1 x 8 with 10k KV tokens a replica (two requests fit): the lookahead
    # bundles a replica's 128 requests into 24 units of 5.3 requests, each unit given 1/5.3 of the KV (1875 tokens),
    # less than any unit's 3.5k. It used to raise "no request fits in 1875 KV tokens".
    model = LatencyModel.from_json("h100_llama31_8b")
    own = EngineSpec.default_for(model, model.tps)
    small = EngineSpec(scheduler=own.scheduler, kv_tokens={tp: 10_000 for tp in model.tps})
    requests = _requests(1024)
    planner = Planner(model, PlannerConfig(candidate_tps=(1, 2, 4, 8), estimator="lookahead"))
    planner.decide(ClusterState(step=0, num_devices=8, tp=1, requests=requests, reported_spec=small))
    now_s, _ = planner.evaluate(ClusterState(step=0, num_devices=8, tp=1, requests=requests, reported_spec=small))
    ample, _ = planner.evaluate(ClusterState(step=0, num_devices=8, tp=1, requests=requests, reported_spec=own))
    assert 0 < ample < now_s  # KV-bound: staying takes longer than with the profile's own KV
