"""4 Ray actors: 4xTP1 -> 2xTP2 -> 1xTP4 mid-decode (TP4 replicates the 2 KV heads) and back to
the base layout exactly, then a weight update and a second stage, with outputs equal to a static 4xTP1 run."""

from __future__ import annotations

import pytest
import torch
from pool_helpers import bounded, pool_config, skewed_requests, wait_first_done
from safetensors.torch import load_file

from pat_rollout.driver import RolloutDriver
from pat_rollout.layout import Layout

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_4xtp1_to_2xtp2_to_1xtp4(ray_cluster, tiny_models):
    requests = skewed_requests(n=8, long_len=40)
    cfg = dict(num_devices=4, kv_handoff="migrate", steps_per_poll=4)
    static = RolloutDriver(pool_config(tiny_models["qwen3"], policy="static", **cfg))
    try:
        reference = static.generate(requests, timeout=300)
    finally:
        static.shutdown()
    driver = RolloutDriver(pool_config(tiny_models["qwen3"], **cfg))
    try:
        futures = [driver.submit(r) for r in requests]
        wait_first_done(futures)
        bounded(lambda: driver.reconfigure(2), 300)
        assert driver.layout.num_replicas == 2
        bounded(lambda: driver.reconfigure(4), 300)
        assert driver.layout.groups == ((0, 2, 1, 3),)  # interleaved: every new shard is a slice of the old
        # one shrink straight back: the base itself, not [[0],[2],[1],[3]]
        bounded(lambda: driver.reconfigure(1), 300)
        assert driver.layout == Layout.uniform(4, 1)
        outputs = [f.result(timeout=300) for f in futures]
        metrics = driver.stage_metrics()
        weights = load_file(f"{tiny_models['qwen3']}/model.safetensors")
        driver.update_weights((n, t.to(torch.float64)) for n, t in weights.items())  # raised outside the base
        second = driver.generate(requests, timeout=300)
        second_metrics = driver.stage_metrics()
    finally:
        driver.shutdown()
    for outs in (outputs, second):
        assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
        for o, r in zip(outs, reference):
            assert max(abs(a - b) for a, b in zip(o.log_probs, r.log_probs)) < 1e-9
    assert metrics["pat/num_reconfigs"] == 3 and metrics["pat/num_migrated"] >= 2
    assert metrics["pat/kv_bytes_received"] > 0 and metrics["pat/num_import_fallbacks"] == 0
    # the second stage starts in the base layout: no (no-op) reconfiguration at its start
    assert second_metrics["pat/num_reconfigs"] == 0 and second_metrics["pat/layouts"].count("TP") == 1
