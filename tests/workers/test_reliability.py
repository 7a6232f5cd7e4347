"""Fault injection on 2 Ray actors: every failure ends in bounded time with every request resolved, either
finished exactly as a clean run would or failed with an error naming the phase and the device; a pool
that cannot recover is marked broken and says so at once. A hang is a test failure (`bounded`)."""

from __future__ import annotations

import dataclasses
import time

import pytest
from pool_helpers import bounded, pool_config, skewed_requests, wait_first_done

from pat_rollout.driver import RolloutDriver
from pat_rollout.driver.errors import PoolBrokenError
from pat_rollout.layout import Layout
from pat_rollout.workers.reconfigure import ReconfigurationError

pytestmark = [pytest.mark.ray, pytest.mark.slow]

BASE = Layout.uniform(2, 1)
CFG = dict(num_kv_blocks=128, kv_handoff="migrate")


@pytest.fixture(scope="module")
def requests():
    return skewed_requests(long_len=100)


@pytest.fixture(scope="module")
def reference(ray_cluster, tiny_models, requests):
    driver = RolloutDriver(pool_config(tiny_models["llama"], policy="static", **CFG))
    try:
        return [o.token_ids for o in driver.generate(requests, timeout=120)]
    finally:
        driver.shutdown()


def _fail_next(driver, device: int, phase: str, hang_s: float = 0.0) -> None:
    driver.pool.group.call([device], "fail_next", phase, hang_s)


def test_failure_in_every_transfer_phase_rolls_back_and_loses_nothing(tiny_models, requests, reference):
    """Export (requests already exported by the healthy device), KV hand-off and a shrink's weight
    transfers with the peer blocked in gloo (released by the failed device's abort): all roll back, the
    communicators are rebuilt, and the next switch works."""
    driver = RolloutDriver(pool_config(tiny_models["llama"], comm_timeout_s=3, **CFG))
    try:
        futures = driver.submit_many(requests)
        wait_first_done(futures)
        _fail_next(driver, 1, "export")
        with pytest.raises(ReconfigurationError, match=r"failed in export .*injected failure in phase 'export' on "
                                                       r"device 1.*unfinished requests re-imported"):
            bounded(lambda: driver.reconfigure(2))
        assert driver.layout == BASE
        _fail_next(driver, 1, "kv")
        with pytest.raises(ReconfigurationError, match=r"failed in KV hand-off .*device 0 failed in KV hand-off.*"
                                                       r"Connection (closed|reset) by peer.*injected failure in "
                                                       r"phase 'kv' on device 1"):
            bounded(lambda: driver.reconfigure(2))
        assert driver.layout == BASE
        bounded(lambda: driver.reconfigure(2))  # rebuilt communicators carry a switch
        assert driver.layout.tp_size == 2
        _fail_next(driver, 1, "reshard")
        with pytest.raises(ReconfigurationError, match=r"failed in reshard .*injected failure in phase 'reshard'"):
            bounded(lambda: driver.reconfigure(1))
        assert driver.layout == BASE
        outputs = [f.result(timeout=120) for f in futures]
        metrics = driver.stage_metrics()
        info = driver.worker_info()
        plans = driver.pool.reconfigurer.plans
    finally:
        driver.shutdown()
    assert [o.token_ids for o in outputs] == reference
    assert metrics["pat/num_failed_reconfigs"] == 3 and metrics["pat/num_reconfigs"] == 1
    assert [i["num_comm_builds"] for i in info] == [3, 3]  # start-up, after the KV and the reshard failures
    assert plans.misses == 2 and plans.hits == 2  # 1->2 planned once and reused twice, 2->1 once


def test_failed_transfer_releases_its_peer_in_seconds_at_default_timeouts(tiny_models, requests, reference):
    """With comm_timeout_s at its default (120 s), a device that fails the KV hand-off or a shrink's weight
    transfers while its peer waits for its messages releases that peer at once (the failure aborts its
    transport), and one that is merely late lets the peer go after the transfer floor (5 s), not after
    120 s. Each failure resolves in a rollback and later outputs equal a clean run."""
    cfg = pool_config(tiny_models["llama"], **CFG)
    assert (cfg.comm_timeout_s, cfg.transfer_timeout_floor_s) == (120, 5)
    driver = RolloutDriver(cfg)

    def failed_switch(tp: int, match: str) -> float:
        t0 = time.monotonic()
        with pytest.raises(ReconfigurationError, match=match):
            bounded(lambda: driver.reconfigure(tp), 60)
        assert driver.layout == BASE
        return time.monotonic() - t0

    try:
        futures = driver.submit_many(requests)
        wait_first_done(futures)  # the long requests of both replicas migrate: each device waits for the other
        _fail_next(driver, 1, "kv")
        kv_s = failed_switch(2, r"failed in KV hand-off .*device 0 failed in KV hand-off: RuntimeError\('device 0: "
                                r"transfer .* with devices \[1\] failed after .*Connection (closed|reset) by "
                                r"peer.*injected failure in phase 'kv' on device 1.*unfinished requests re-imported")
        bounded(lambda: driver.reconfigure(2))
        _fail_next(driver, 1, "reshard")  # 1xTP2 -> 2xTP1: device 0 waits for device 1's half of every shard
        reshard_s = failed_switch(1, r"failed in reshard .*device 0 failed in reshard: RuntimeError\('device 0: "
                                     r"transfer .* with devices \[1\] failed after .*Connection (closed|reset) by "
                                     r"peer.*injected failure in phase 'reshard' on device 1")
        # Late, then fails: device 0 gives up after floor + bytes / rate (~5 s from when it starts waiting), well
        # before device 1's 15 s end. With 7 s, a device 0 that reached the hand-off 2 s after device 1 began its
        # hang (a CI run with two suites on the 2 cores) saw device 1's abort first: the margin is what separates.
        _fail_next(driver, 1, "kv", hang_s=15)
        late_s = failed_switch(2, r"failed in KV hand-off .*device 0 failed in KV hand-off: RuntimeError\('device 0: "
                                  r"transfer .* with devices \[1\] failed after \d+\.\d s \(limit 5\.\d s for "
                                  r"\d+ bytes\): .*Timed out waiting .*injected failure in phase 'kv' on device 1")
        outputs = [f.result(timeout=120) for f in futures]
        assert [o.token_ids for o in bounded(lambda: driver.generate(requests, timeout=120))] == reference
        info = driver.worker_info()
    finally:
        driver.shutdown()
    # What separates the behaviours: a peer released by the failed device's abort (at once) or by the transfer floor
    # (5 s; the late device itself fails after its 15 s) against one left waiting for comm_timeout_s (120 s). The
    # bound sits between them, not at a duration measured on some machine (seen: a few seconds each, 2 shared cores).
    assert max(kv_s, reshard_s, late_s) < cfg.comm_timeout_s / 2, (kv_s, reshard_s, late_s)
    assert [o.token_ids for o in outputs] == reference
    assert [i["num_comm_builds"] for i in info] == [4, 4]  # start-up, then one rebuild per failed transfer


def test_hung_device_breaks_the_pool_with_a_clear_error(tiny_models, requests):
    driver = RolloutDriver(pool_config(tiny_models["llama"], comm_timeout_s=2, rpc_timeout_s=2,
                                       rpc_timeout_per_token_s=0.001, **CFG))
    try:
        futures = driver.submit_many(requests)
        wait_first_done(futures)
        _fail_next(driver, 1, "kv", hang_s=600)
        with pytest.raises(PoolBrokenError, match=r"failed in KV hand-off.*device 1 did not answer KV hand-off "
                                                  r"within .* s.*broken"):
            bounded(lambda: driver.reconfigure(2))
        unfinished = [f for f in futures if f.exception(timeout=30) is not None]
        assert unfinished, "the long requests were in flight"
        for f in unfinished:
            assert isinstance(f.exception(), PoolBrokenError) and "device 1" in str(f.exception())
        t0 = time.monotonic()
        with pytest.raises(PoolBrokenError, match="pool is broken: .*KV hand-off"):
            bounded(lambda: driver.generate(requests, timeout=60), 10)
        with pytest.raises(PoolBrokenError, match="pool is broken"):
            bounded(lambda: driver.reconfigure(2), 10)
        assert time.monotonic() - t0 < 5  # at once, not after another deadline
    finally:
        bounded(driver.shutdown)


def test_errors_abort_engine_copies_and_batches_are_atomic(tiny_models, tmp_path, requests, reference):
    import torch
    from safetensors.torch import load_file

    driver = RolloutDriver(pool_config(tiny_models["llama"], **CFG))
    try:
        with pytest.raises(ValueError, match=r"\['r0'\] repeated in one batch; nothing was submitted"):
            bounded(lambda: driver.generate([*requests, requests[0]], timeout=60), 10)
        too_long = dataclasses.replace(skewed_requests(n=1, long_len=4000)[0], request_id="too_long")
        with pytest.raises(ValueError, match="max_new_tokens 4000"):
            bounded(lambda: driver.generate([*requests[:3], too_long], timeout=60), 10)
        assert [o.token_ids for o in bounded(lambda: driver.generate(requests, timeout=120))] == reference

        _fail_next(driver, 0, "step")  # a device fails mid-decode: its requests fail, the engines forget them
        for f in driver.submit_many(requests):
            with pytest.raises(RuntimeError, match=r"device 0 failed in decode step.*injected failure in phase "
                                                   r"'step' on device 0"):
                f.result(timeout=60)
        assert [i["num_unfinished"] for i in driver.worker_info()] == [0, 0]
        assert [o.token_ids for o in bounded(lambda: driver.generate(requests, timeout=120))] == reference

        bounded(driver.release)
        with pytest.raises(RuntimeError, match=r"KV cache is released; call resume"):
            bounded(lambda: driver.generate(requests, timeout=60), 10)
        bounded(driver.resume)
        assert [o.token_ids for o in bounded(lambda: driver.generate(requests, timeout=120))] == reference

        # verl sends an update in buckets: each writes only its own tensors' base-layout slices into the rollback
        # backup (no full copy per bucket), and the backup ends up equal to the weights the engines serve
        weights = sorted(load_file(f"{tiny_models['llama']}/model.safetensors").items())
        for i in range(3):
            bounded(lambda: driver.update_weights((n, t.to(torch.float64)) for n, t in weights[i::3]))
        bounded(lambda: driver.reconfigure(2))
        bounded(lambda: driver.reconfigure(1))
        for w in driver.pool.group.call(range(2), "weight_shards"):
            assert w["engine"].keys() == w["backup"].keys()
            assert all(torch.equal(t, w["backup"][n]) for n, t in w["engine"].items())
        assert [o.token_ids for o in bounded(lambda: driver.generate(requests, timeout=120))] == reference
    finally:
        driver.shutdown()


def test_shutdown_fails_in_flight_requests_and_every_later_call(tiny_models, requests):
    driver = RolloutDriver(pool_config(tiny_models["llama"], **CFG))
    futures = driver.submit_many(requests)
    wait_first_done(futures)
    bounded(driver.shutdown)
    errors = [f.exception(timeout=10) for f in futures]
    assert any(errors), "the long requests were in flight"
    assert all("shut down with" in str(e) for e in errors if e is not None)
    for call in (lambda: driver.reconfigure(2), lambda: driver.generate(requests), lambda: driver.abort_all(),
                 lambda: driver.update_weights([]), lambda: driver.release(), lambda: driver.resume(),
                 lambda: driver.worker_info()):
        with pytest.raises(RuntimeError, match="RolloutDriver is shut down"):
            bounded(call, 10)
    bounded(driver.shutdown)  # idempotent
