"""The poll snapshot in the planner's ClusterState (issue #24 item 1): ReplicaLoad's checks, ClusterState's, and the
lookahead scoring on the engine spec the pool reported, not on its own default; and next_start_tp, the layout the
weight update loads into (item 5)."""

from __future__ import annotations

import pytest

from pat_rollout.planner import ClusterState, EngineSpec, Planner, PlannerConfig, ReplicaLoad, ReqProgress
from pat_rollout.profile.model import LatencyModel


def test_replica_load_checks_its_counts() -> None:
    load = ReplicaLoad(num_waiting=3, num_running=2, kv_tokens_used=100, kv_tokens_capacity=256)
    assert load.kv_tokens_free == 156
    for bad in ({"num_waiting": -1}, {"kv_tokens_used": 300}, {"kv_tokens_capacity": 0, "kv_tokens_used": 0}):
        with pytest.raises(ValueError, match="kv_tokens_capacity"):
            ReplicaLoad(**{"num_waiting": 0, "num_running": 0, "kv_tokens_used": 0, "kv_tokens_capacity": 256,
                           **bad})


def test_cluster_state_wants_one_load_per_replica() -> None:
    load = ReplicaLoad(num_waiting=0, num_running=0, kv_tokens_used=0, kv_tokens_capacity=8)
    assert ClusterState(step=0, num_devices=4, tp=2, requests=(), loads=(load, load)).num_replicas == 2
    with pytest.raises(ValueError, match="3 replica loads for 2 replicas"):
        ClusterState(step=0, num_devices=4, tp=2, requests=(), loads=(load,) * 3)


def _requests(n: int) -> tuple[ReqProgress, ...]:
    return tuple(ReqProgress(request_id=f"r{i}", prompt_key=None, num_prompt_tokens=500, num_output_tokens=10,
                             max_new_tokens=2000, replica=i % 4, cached=True) for i in range(n))


def test_lookahead_scores_on_the_reported_engine_spec() -> None:
    model = LatencyModel.from_json("h100_llama31_8b")
    planner = Planner(model, PlannerConfig(candidate_tps=(2, 4), estimator="lookahead"))
    own = EngineSpec.default_for(model, model.tps)
    requests = _requests(256)
    state = ClusterState(step=0, num_devices=8, tp=2, requests=requests)
    now_s, _ = planner.evaluate(state)
    same, _ = planner.evaluate(ClusterState(step=0, num_devices=8, tp=2, requests=requests, reported_spec=own))
    assert same == pytest.approx(now_s)
    # the pool says a replica holds far fewer KV tokens than the profile's memory section implies: requests queue
    # and re-prefill, so staying takes longer
    small = EngineSpec(scheduler=own.scheduler, kv_tokens={tp: 40_000 for tp in model.tps})
    assert small.capacity(2) < own.capacity(2)
    slow, _ = planner.evaluate(ClusterState(step=0, num_devices=8, tp=2, requests=requests, reported_spec=small))
    assert slow > 1.2 * now_s


def test_next_start_tp_is_the_latest_stage_start() -> None:
    model = LatencyModel.from_json("h100_llama31_8b")
    planner = Planner(model, PlannerConfig(candidate_tps=(1, 2, 4, 8), calibrate=False))
    assert planner.next_start_tp() is None  # no stage chose yet: the driver uses the base layout
    batch = tuple(ReqProgress(request_id=f"r{i}", prompt_key=None, num_prompt_tokens=200, num_output_tokens=0,
                              max_new_tokens=4000) for i in range(2))
    decision = planner.choose_start(ClusterState(step=0, num_devices=8, tp=1, requests=batch))
    assert decision is not None and decision.target_tp > 1  # two long requests: a big TP
    assert planner.next_start_tp() == decision.target_tp
    planner.start_stage()
    # the next stage, started where the weights were loaded, stays there
    assert planner.choose_start(ClusterState(step=0, num_devices=8, tp=decision.target_tp, requests=batch)) is None
    assert planner.next_start_tp() == decision.target_tp
    planner.start_stage()
    again = planner.choose_start(ClusterState(step=0, num_devices=8, tp=1, requests=batch))
    planner.cancel(again)  # its switch rolled back: the pool is in its base layout
    assert planner.next_start_tp() is None
    off = Planner(model, PlannerConfig(candidate_tps=(1, 2, 4, 8), calibrate=False, start_layout=False))
    off.choose_start(ClusterState(step=0, num_devices=8, tp=1, requests=batch))
    assert off.next_start_tp() is None
