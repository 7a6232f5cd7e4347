"""Rebalancing mid-decode on real Ray actors: requests moved between replicas of one layout (KV migration or
recomputation) finish exactly as in a static run; a failure in any phase re-admits every moved request."""

from __future__ import annotations

import pytest
from pool_helpers import bounded, one_replica_long, pool_config, skewed_requests, wait_first_done

from pat_rollout.driver import RolloutDriver
from pat_rollout.workers.rebalance import RebalanceError

pytestmark = [pytest.mark.ray, pytest.mark.slow]

_REFERENCE: dict = {}


def _reference(model_path: str, requests, **cfg) -> list:
    """A static run of `requests`, cached across the tests of this module."""
    key = (model_path, tuple(r.request_id for r in requests), tuple(sorted(cfg.items())))
    if key not in _REFERENCE:
        driver = RolloutDriver(pool_config(model_path, policy="static", **cfg))
        try:
            _REFERENCE[key] = driver.generate(requests, timeout=300)
        finally:
            driver.shutdown()
    return _REFERENCE[key]


def _assert_same(outputs, reference) -> None:
    assert [o.request_id for o in outputs] == [o.request_id for o in reference]
    for o, r in zip(outputs, reference):
        assert o.token_ids == r.token_ids, o.request_id
        assert o.finish_reason == r.finish_reason
        assert max(abs(a - b) for a, b in zip(o.log_probs, r.log_probs)) < 1e-9


@pytest.mark.parametrize("handoff", ["migrate", "recompute"])
def test_rebalance_2_actors_matches_static(ray_cluster, tiny_models, handoff):
    requests = one_replica_long(skewed_requests(), 2)
    reference = _reference(tiny_models["llama"], requests)
    driver = RolloutDriver(pool_config(tiny_models["llama"], kv_handoff=handoff))
    try:
        futures = [driver.submit(r) for r in requests]
        wait_first_done(futures)
        assert {rid: r for rid, r in driver.assignment.items() if rid in ("r0", "r1")} == {"r0": 0, "r1": 0}
        bounded(lambda: driver.rebalance({"r1": 1}), 300)  # the second long request joins the short ones
        assert driver.assignment.get("r1", 1) == 1 and str(driver.layout).startswith("2xTP1")
        outputs = [f.result(timeout=300) for f in futures]
        metrics = driver.stage_metrics()
    finally:
        driver.shutdown()
    _assert_same(outputs, reference)
    assert metrics["pat/num_rebalances"] == 1 and metrics["pat/num_rebalanced"] == 1, metrics
    assert metrics[f"pat/num_{'migrated' if handoff == 'migrate' else 'recomputed'}"] == 1, metrics
    assert metrics["pat/num_reconfigs"] == 0
    for phase in ("plan", "export", "kv_handoff", "release", "import"):
        assert metrics[f"pat/rebalance_{phase}_s"] >= 0
    assert metrics["pat/replica_finish_spread_s"] >= 0


@pytest.mark.parametrize("handoff", ["migrate", "recompute"])
def test_rebalance_4_actors_tp1_and_tp2_sampled(ray_cluster, tiny_models, handoff):
    requests = one_replica_long(skewed_requests(n=8, long_len=56, temperature=0.8), 4)
    cfg = dict(num_devices=4, steps_per_poll=4)
    reference = _reference(tiny_models["qwen3"], requests, **cfg)
    driver = RolloutDriver(pool_config(tiny_models["qwen3"], kv_handoff=handoff, **cfg))
    try:
        futures = [driver.submit(r) for r in requests]
        wait_first_done(futures)
        bounded(lambda: driver.rebalance({"r1": 3}), 300)  # 4 x TP1: replica 0 -> replica 3
        bounded(lambda: driver.reconfigure(2), 300)
        where = driver.assignment
        assert driver.layout.num_replicas == 2 and "r0" in where
        # 2 x TP2: KV heads split over both devices of each replica
        bounded(lambda: driver.rebalance({"r0": 1 - where["r0"]}), 300)
        outputs = [f.result(timeout=300) for f in futures]
        metrics = driver.stage_metrics()
    finally:
        driver.shutdown()
    _assert_same(outputs, reference)
    assert metrics["pat/num_rebalances"] == 2 and metrics["pat/num_rebalanced"] == 2, metrics
    assert metrics["pat/num_reconfigs"] == 1
    # every hand-off (two rebalanced requests, the regroup's unfinished ones) went the forced way
    done, other = ("migrated", "recomputed") if handoff == "migrate" else ("recomputed", "migrated")
    assert metrics[f"pat/num_{done}"] >= 2 and metrics[f"pat/num_{other}"] == 0, metrics


def test_failed_rebalance_loses_nothing(ray_cluster, tiny_models):
    requests = one_replica_long(skewed_requests(), 2)
    reference = _reference(tiny_models["llama"], requests)
    driver = RolloutDriver(pool_config(tiny_models["llama"], kv_handoff="migrate"))
    try:
        futures = [driver.submit(r) for r in requests]
        wait_first_done(futures)
        for device, phase in ((1, "import"), (0, "release"), (0, "export")):
            driver.pool.group.call([device], "fail_next", phase)
            with pytest.raises(RebalanceError, match=f"injected failure in phase '{phase}' on device {device}"):
                bounded(lambda: driver.rebalance({"r1": 1}), 300)
            assert driver.assignment.get("r1", 0) == 0  # re-admitted on its source replica
        with pytest.raises(ValueError, match="cannot move to replica 5"):
            bounded(lambda: driver.rebalance({"r1": 5}), 300)
        outputs = [f.result(timeout=300) for f in futures]
        metrics = driver.stage_metrics()
    finally:
        driver.shutdown()
    _assert_same(outputs, reference)
    assert metrics["pat/num_failed_rebalances"] == 3 and metrics["pat/num_rebalances"] == 0, metrics


def test_planner_rebalances_a_skewed_dispatch(ray_cluster, tiny_models, tmp_path):
    from pool_helpers import write_profile

    # TP1 is the fast layout (so regrouping loses) and its step time grows with the batch: moving a long request
    # off the loaded replica pays, and the planner must do it by itself.
    profile = write_profile(tmp_path / "tp1_fast.json", fast_tp=1)
    requests = one_replica_long(skewed_requests(), 2)
    reference = _reference(tiny_models["llama"], requests)
    # the hand-made profile alone decides: measured CPU times must not overrule it
    planner = {"eval_every_steps": 2, "min_steps_between_switches": 2, "min_gain_s": 0.0, "min_gain_ratio": 0.0,
               "start_layout": False, "calibrate": False}
    driver = RolloutDriver(pool_config(tiny_models["llama"], policy="pat", profile_path=profile, planner=planner))
    try:
        outputs = driver.generate(requests, timeout=300)
        metrics = driver.stage_metrics()
    finally:
        driver.shutdown()
    _assert_same(outputs, reference)
    assert metrics["pat/num_rebalances"] >= 1 and metrics["pat/num_reconfigs"] == 0, metrics
