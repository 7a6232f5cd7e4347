"""Issue #24 item 1, the poll snapshot: what the reference pool's poll reports reaches the planner's ClusterState
(per-replica ReplicaLoad, per-request `cached`, the engine spec the pool states, its one-time entry costs)."""

from __future__ import annotations

import math

import pytest
from pool_helpers import pool_config, skewed_requests

from pat_rollout.driver import RolloutDriver
from pat_rollout.driver.planner_glue import cluster_state
from pat_rollout.engine.base import EngineSnapshot, RunningInfo
from pat_rollout.planner import EngineSpec, ReplicaLoad, SchedulerModel
from pat_rollout.types import Request, SamplingParams


def _req(rid: str, prompt: int = 5, max_new: int = 20) -> Request:
    return Request(request_id=rid, prompt_token_ids=tuple(range(3, 3 + prompt)),
                   sampling=SamplingParams(max_new_tokens=max_new, ignore_eos=True))


def _info(rid: str, out: int, prompt: int = 5) -> RunningInfo:
    return RunningInfo(request_id=rid, num_prompt_tokens=prompt, num_output_tokens=out, max_new_tokens=20)


def test_cluster_state_carries_the_poll_snapshot() -> None:
    requests = {rid: _req(rid) for rid in ("a", "b", "c", "d")}
    # a, b run on replica 0; c was preempted there (its last progress known, its KV gone); d is queued on replica 2;
    # replica 1 holds nothing, so the poll did not step it
    progress = {"a": _info("a", 7), "b": _info("b", 3), "c": _info("c", 4)}
    snaps = {0: EngineSnapshot(running=(progress["a"], progress["b"]), num_waiting=1, num_free_blocks=60,
                               num_total_blocks=64, block_size=4),
             2: EngineSnapshot(running=(), num_waiting=1, num_free_blocks=64, num_total_blocks=64, block_size=4)}
    spec = EngineSpec(scheduler=SchedulerModel(kind="ref", max_num_seqs=2), kv_tokens={1: 256})
    state = cluster_state(10, 3, 1, requests, progress, {r: r for r in requests}, {"a": 0, "b": 0, "c": 0, "d": 2},
                          snapshots=snaps, reported_spec=spec)
    assert state.loads == (ReplicaLoad(num_waiting=1, num_running=2, kv_tokens_used=16, kv_tokens_capacity=256),
                           ReplicaLoad(num_waiting=0, num_running=0, kv_tokens_used=0, kv_tokens_capacity=256),
                           ReplicaLoad(num_waiting=1, num_running=0, kv_tokens_used=0, kv_tokens_capacity=256))
    assert {r.request_id: r.cached for r in state.requests} == {"a": True, "b": True, "c": False, "d": False}
    assert {r.request_id: r.num_output_tokens for r in state.requests} == {"a": 7, "b": 3, "c": 4, "d": 0}
    assert state.reported_spec is spec
    # a pool that does not report its engines' load: nothing claimed
    bare = cluster_state(10, 3, 1, requests, progress, {r: r for r in requests}, {"a": 0, "b": 0, "c": 0, "d": 2})
    assert bare.loads == () and bare.reported_spec is None and all(r.cached is None for r in bare.requests)


PLANNER = {"eval_every_steps": 2, "min_steps_between_switches": 2, "min_gain_s": 0.0, "min_gain_ratio": 0.0,
           "start_layout": False, "calibrate": False}


@pytest.mark.ray
@pytest.mark.slow
def test_reference_pool_poll_reaches_the_planner(ray_cluster, tiny_models, tiny_profile):
    """max_num_seqs=2 with 4 requests per replica: requests queue, and each poll's ClusterState says which run
    (with their KV tokens) and which wait, replica by replica, exactly as the engines hold them."""
    cfg = pool_config(tiny_models["llama"], policy="pat", profile_path=tiny_profile, planner=PLANNER,
                      max_num_seqs=2)
    driver = RolloutDriver(cfg)
    states = []
    decide = driver.planner.decide

    def recording(state):
        states.append(state)
        return decide(state)

    driver.planner.decide = recording
    driver.pool.entry_cost_s = lambda tp: 7.5 if tp == 2 else 0.0  # as a pool with TP2's graphs not captured says
    try:
        outputs = driver.generate(skewed_requests(n=8, long_len=24), timeout=300)
        spec = driver.pool.engine_spec()
    finally:
        driver.shutdown()
    assert len(outputs) == 8 and states
    assert spec == EngineSpec(scheduler=SchedulerModel(kind="ref", max_num_seqs=2, max_prefill_tokens=2048,
                                                       block_size=4), kv_tokens={1: 256, 2: 256})
    bs = cfg.block_size
    for state in states:
        assert state.reported_spec == spec
        assert state.entry_s == ((2, 7.5),)  # the pool's one-time entry costs, non-zero ones only
        assert len(state.loads) == state.num_replicas
        for r, load in enumerate(state.loads):
            mine = [p for p in state.requests if p.replica == r]
            running = [p for p in mine if p.cached]
            assert load.kv_tokens_capacity == cfg.num_kv_blocks * bs
            assert (load.num_running, load.num_waiting) == (len(running), len(mine) - len(running)), (r, state)
            assert load.num_running <= 2
            # a running request holds blocks for every token but the one it just sampled, at most a block over
            assert sum(math.ceil((p.num_tokens - 1) / bs) for p in running) * bs <= load.kv_tokens_used
            assert load.kv_tokens_used <= sum(math.ceil(p.num_tokens / bs) for p in running) * bs
    assert any(load.num_waiting for s in states for load in s.loads)  # the queue was seen
    assert all(p.cached is not None for s in states for p in s.requests)
