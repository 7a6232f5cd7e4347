"""The reference pool under a KV hand-off cap (kv_handoff_max_bytes): requests whose KV would not fit a receiving
device are recomputed instead of migrated (`kv.cost.fit_to_cap`, shared with SglPool), and outputs still equal an
unreconfigured run exactly."""

from __future__ import annotations

import pytest
from pool_helpers import pool_config, skewed_requests, wait_first_done
from test_reconfigure_equivalence import _assert_same, _baseline

from pat_rollout.driver import RolloutDriver

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_capped_handoff_recomputes_the_overflow_and_matches_static(ray_cluster, tiny_models):
    requests = skewed_requests()
    reference = _baseline(tiny_models["llama"], requests)
    # tiny llama in float64: a TP2 device receives 2 layers x 2 x 1 KV head x 16 x 8 B = 512 B per token; 8 KiB holds
    # 16 tokens, less than the unfinished requests' contexts together (which ones remain at the switch varies)
    driver = RolloutDriver(pool_config(tiny_models["llama"], kv_handoff="migrate", kv_handoff_max_bytes=8 << 10))
    try:
        futures = [driver.submit(r) for r in requests]
        wait_first_done(futures)
        driver.reconfigure(2)
        grow = driver.last_reconfig
        driver.reconfigure(1)
        outputs = [f.result(timeout=300) for f in futures]
    finally:
        driver.shutdown()
    _assert_same(outputs, reference)
    # kv_handoff="migrate" forces migration: a recomputed request is one the cap turned away
    assert grow.recomputed, (grow.migrated, grow.recomputed)
    assert grow.kv_bytes_received <= 2 * (8 << 10)  # the cap per device, 2 devices
