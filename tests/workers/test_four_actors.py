"""4 Ray actors: 4xTP1 -> 2xTP2 -> 1xTP4 mid-decode (TP4 replicates the 2 KV heads) and back to
the base layout for the next stage, with outputs equal to a static 4xTP1 run."""

from __future__ import annotations

import pytest
from pool_helpers import pool_config, skewed_requests, wait_first_done

from pat_rollout.workers.driver import RolloutDriver

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_4xtp1_to_2xtp2_to_1xtp4(ray_cluster, tiny_models):
    requests = skewed_requests(n=8, long_len=40)
    cfg = dict(num_devices=4, kv_handoff="migrate", steps_per_poll=4)
    static = RolloutDriver(pool_config(tiny_models["qwen3"], policy="static", **cfg))
    try:
        reference = static.generate(requests)
    finally:
        static.shutdown()
    driver = RolloutDriver(pool_config(tiny_models["qwen3"], **cfg))
    try:
        futures = [driver.submit(r) for r in requests]
        wait_first_done(futures)
        driver.reconfigure(2)
        assert driver.layout.num_replicas == 2
        driver.reconfigure(4)
        assert driver.layout.groups == ((0, 2, 1, 3),)  # interleaved: every new shard is a slice of the old
        outputs = [f.result(timeout=300) for f in futures]
        metrics = driver.stage_metrics()
    finally:
        driver.shutdown()
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    for o, r in zip(outputs, reference):
        assert max(abs(a - b) for a, b in zip(o.log_probs, r.log_probs)) < 1e-9
    assert metrics["pat/num_reconfigs"] == 2 and metrics["pat/num_migrated"] >= 2
