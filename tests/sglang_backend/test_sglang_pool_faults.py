"""Faults on the SGLang pool (2 scheduler ranks, CPU): each ends in bounded time with every request resolved.

- A raise on ONE rank in each phase of `pat_switch` (export, KV hand-off, reshard, rebuild, import) rolls back
  to the base layout; the error names the phase and the rank; outputs then equal HF greedy (a clean run); the
  same pool then switches cleanly (its transfer group, closed by the failed rank's abort, is re-created).
- A hung rank: the RPC misses `PatRolloutConfig.rpc_deadline_s`, the pool is broken (`PoolBrokenError` naming
  the call, the rank and its phase), every in-flight request fails with it, shutdown completes.
- A killed scheduler process mid-stage: `PoolBrokenError` naming the rank, every request fails, shutdown
  completes (and this process survives SGLang's SIGQUIT, `rank_rpc.child_failed`).
Every wait is bounded (`bounded`, `result(timeout=)`), so a hang fails the test instead of blocking it.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

pytest.importorskip("sglang.srt")

from pat_rollout.config import PatRolloutConfig  # noqa: E402
from pat_rollout.types import Request, SamplingParams  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

MAX_NEW = 40


def bounded(fn, seconds: float = 120):
    """fn() in a thread; its result or exception, or a test failure if it still runs after `seconds`."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised in the caller
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} hung for more than {seconds} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _config(path: str, **kw) -> PatRolloutConfig:
    return PatRolloutConfig(model_path=path, num_devices=2, backend="sglang", initial_tp=1, candidate_tps=(1, 2),
                            policy="manual", kv_handoff="migrate", dtype="float32", steps_per_poll=2, **kw)


def _requests(tag: str, n: int = 4, max_new: int = MAX_NEW) -> list[Request]:
    sp = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    return [Request(request_id=f"{tag}{i}", prompt_token_ids=tuple(range(3 + 5 * i, 12 + 7 * i)), sampling=sp)
            for i in range(n)]


def _wait_tokens(driver, futures, n: int, timeout: float = 120) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        progress = dict(driver._progress)
        if all(f.done() or (rid in progress and progress[rid].num_output_tokens >= n) for rid, f in futures.items()):
            return
        time.sleep(0.01)
    pytest.fail(f"requests did not reach {n} tokens in {timeout} s")


@pytest.fixture(scope="module")
def pool(tiny_models):
    from pat_rollout.driver import RolloutDriver

    driver = RolloutDriver(_config(tiny_models["llama"]))
    yield driver
    bounded(driver.shutdown, 120)


# (phase, rank, what the error says): a raise on one rank only; the other rank fails too in the phases with a
# collective (export agrees on failure; a transfer's peer sees the failed rank's abort) and finishes otherwise.
CASES = [
    ("export", 1, r"rank 0 failed in phase export: RuntimeError: rank 0: export failed on rank\(s\) \[1\]: .*"
                  r"rank 1 failed in phase export: RuntimeError: injected failure in SglPool switch phase 'export' "
                  r"on rank 1"),
    ("kv", 1, r"rank 0 failed in phase kv: .*rank 1 failed in phase kv: RuntimeError: injected failure in SglPool "
              r"switch phase 'kv' on rank 1"),
    ("kv", 0, r"rank 0 failed in phase kv: RuntimeError: injected failure in SglPool switch phase 'kv' on rank 0; "
              r"rank 1 failed in phase kv"),
    ("reshard", 1, r"rank 1 failed in phase reshard: RuntimeError: injected failure in SglPool switch phase "
                   r"'reshard' on rank 1"),
    ("switch", 1, r"SglPool RPC pat_switch failed: rank 1 failed in phase switch: RuntimeError: injected failure"),
    ("import", 0, r"SglPool RPC pat_switch failed: rank 0 failed in phase import: RuntimeError: injected failure"),
]


@pytest.mark.parametrize("phase,rank,message", CASES, ids=[f"{p}-rank{r}" for p, r, _ in CASES])
def test_one_rank_fails_a_switch_phase_and_the_pool_rolls_back(pool, tiny_models, hf_reference, phase, rank,
                                                               message):
    from pat_rollout.driver.errors import ReconfigurationError

    reqs = _requests(f"{phase}{rank}-")
    futures = {r.request_id: pool.submit(r) for r in reqs}
    _wait_tokens(pool, futures, 6)
    pool.pool.fail_next(phase, rank=rank)
    t0 = time.monotonic()
    with pytest.raises(ReconfigurationError, match=r"rolled back to base layout") as info:
        bounded(lambda: pool.reconfigure(2), 60)
    elapsed = time.monotonic() - t0
    assert pool.broken is None
    assert str(pool.layout).startswith("2xTP1")
    assert re.search(message, str(info.value)), str(info.value)
    outs = {rid: f.result(timeout=120) for rid, f in futures.items()}  # no request lost
    for r in reqs:
        ref_ids, _ = hf_reference(tiny_models["llama"], list(r.prompt_token_ids), MAX_NEW)
        assert list(outs[r.request_id].token_ids) == ref_ids, (phase, rank, r.request_id)
    assert [i["kv_heads"] for i in pool.worker_info()] == [2, 2]
    # the failed rank released its peer at once (abort) or the failure was agreed on: no transfer timeout waited
    print(f"{phase} on rank {rank}: rolled back in {elapsed:.2f} s")


def test_failed_shrink_reshard_releases_the_blocked_peer(pool, tiny_models, hf_reference):
    """In a shrink (1 x TP2 -> 2 x TP1) each rank receives the other half of every sharded weight: rank 0 fails
    before sending, rank 1 is blocked receiving from it until rank 0's abort closes the transfer group; the
    switch rolls back (from the host backup) well before the transfer timeout, outputs equal HF."""
    from pat_rollout.driver.errors import ReconfigurationError

    reqs = _requests("shrink-")
    futures = {r.request_id: pool.submit(r) for r in reqs}
    _wait_tokens(pool, futures, 6)
    bounded(lambda: pool.reconfigure(2), 60)
    assert str(pool.layout).startswith("1xTP2")
    pool.pool.fail_next("reshard", rank=0)
    t0 = time.monotonic()
    with pytest.raises(ReconfigurationError, match=r"rank 0 failed in phase reshard: RuntimeError: injected failure "
                                                   r"in SglPool switch phase 'reshard' on rank 0; rank 1 failed in "
                                                   r"phase reshard: .*(Connection|closed|reset)"):
        bounded(lambda: pool.reconfigure(1), 60)
    elapsed = time.monotonic() - t0
    assert str(pool.layout).startswith("2xTP1")
    outs = {rid: f.result(timeout=120) for rid, f in futures.items()}
    for r in reqs:
        ref_ids, _ = hf_reference(tiny_models["llama"], list(r.prompt_token_ids), MAX_NEW)
        assert list(outs[r.request_id].token_ids) == ref_ids, r.request_id
    print(f"shrink reshard on rank 0: rolled back in {elapsed:.2f} s")


def test_after_the_failures_the_pool_switches_cleanly(pool, tiny_models, hf_reference):
    """Runs after the fault cases on the same pool: a grow and a shrink mid-decode with KV migration, outputs
    equal HF (the transfer group was re-created after the aborted ones)."""
    reqs = _requests("clean-")
    futures = {r.request_id: pool.submit(r) for r in reqs}
    _wait_tokens(pool, futures, 6)
    bounded(lambda: pool.reconfigure(2), 60)
    assert str(pool.layout).startswith("1xTP2")
    assert set(pool.last_reconfig.migrated) == set(futures)
    _wait_tokens(pool, futures, 20)
    bounded(lambda: pool.reconfigure(1), 60)
    assert str(pool.layout).startswith("2xTP1")
    outs = {rid: f.result(timeout=120) for rid, f in futures.items()}
    for r in reqs:
        ref_ids, _ = hf_reference(tiny_models["llama"], list(r.prompt_token_ids), MAX_NEW)
        assert list(outs[r.request_id].token_ids) == ref_ids, r.request_id


def test_hung_rank_misses_the_rpc_deadline_and_breaks_the_pool(tiny_models, capfd):
    """Rank 1 hangs in the reshard: the switch RPC gives up at rpc_deadline_s (here 2 + 20 s + tokens x 0.01 s:
    room for a slow first forward on a loaded CPU), not when the hang ends (600 s); the schedulers' stacks are in
    the log (the hung rank's shows where it waits); the pool is broken and says so at once; shutdown completes."""
    from pat_rollout.driver import RolloutDriver
    from pat_rollout.driver.errors import PoolBrokenError

    cfg = _config(tiny_models["llama"], comm_timeout_s=2.0, rpc_timeout_s=20.0, rpc_timeout_per_token_s=0.01,
                  transfer_timeout_floor_s=1.0)
    driver = RolloutDriver(cfg)
    try:
        reqs = _requests("hang-", max_new=400)
        futures = {r.request_id: driver.submit(r) for r in reqs}
        _wait_tokens(driver, futures, 4)
        driver.pool.fail_next("reshard", rank=1, hang_s=600)
        t0 = time.monotonic()
        with pytest.raises(PoolBrokenError, match=r"SglPool RPC pat_switch missed its deadline of .* s "
                                                  r"\(PatRolloutConfig.rpc_deadline_s\): .*rank 1 in phase reshard "
                                                  r"did not finish; scheduler rank\(s\) \[1\] hung"):
            bounded(lambda: driver.reconfigure(2), 120)
        elapsed = time.monotonic() - t0
        # the pool's log (SGLang's handler writes it to stderr): one block per rank, up to the next log line
        err = capfd.readouterr().err
        dumps = {int(m[1]): m[2] for m in re.finditer(r"SglPool scheduler rank (\d) \(pid \d+\) stacks:\n(.*?)(?=\n\[|\Z)",
                                                       err, re.S)}
        assert sorted(dumps) == [0, 1], err[-2000:]
        assert re.search(r"line \d+ in _maybe_fail", dumps[1]), dumps[1]  # rank 1 sleeps in the injected hang
        assert "_maybe_fail" not in dumps[0] and "File" in dumps[0], dumps[0]  # rank 0 waits elsewhere
        # the deadline (22 s + the migrated tokens' allowance), not the 600 s hang; loose for a loaded machine
        assert cfg.rpc_deadline_s() <= elapsed < 120, elapsed
        print(f"hung rank: pool broken after {elapsed:.2f} s (deadline {cfg.rpc_deadline_s():.0f} s + tokens)")
        for f in futures.values():  # every in-flight request fails with the broken pool's error
            with pytest.raises(PoolBrokenError, match=r"rank\(s\) \[1\] hung"):
                f.result(timeout=30)
        assert driver.broken is not None and "pat_switch" in driver.broken
        with pytest.raises(PoolBrokenError, match="broken"):
            driver.submit(_requests("after-", 1)[0])
    finally:
        bounded(driver.shutdown, 120)


def test_killed_scheduler_breaks_the_pool_and_fails_every_request(tiny_models):
    """SIGKILL of rank 1's scheduler mid-decode: every request fails with PoolBrokenError naming rank 1 within
    the dead-process check (a fraction of a second per poll), not at a deadline; shutdown completes and this
    process lives on (SGLang's SIGQUIT handler would have killed it)."""
    from pat_rollout.driver import RolloutDriver
    from pat_rollout.driver.errors import PoolBrokenError

    driver = RolloutDriver(_config(tiny_models["llama"], rpc_timeout_s=600.0))  # the deadline is not what fires
    try:
        reqs = _requests("kill-", max_new=400)
        futures = {r.request_id: driver.submit(r) for r in reqs}
        _wait_tokens(driver, futures, 4)
        pid = driver.pool.pids[1]
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        for f in futures.values():
            with pytest.raises(PoolBrokenError, match=r"the scheduler process of rank\(s\) \[(0, )?1\] died"):
                f.result(timeout=60)
        elapsed = time.monotonic() - t0
        assert elapsed < 60, elapsed
        assert driver.broken is not None and "died" in driver.broken
        with pytest.raises(PoolBrokenError):
            bounded(lambda: driver.reconfigure(2), 30)
    finally:
        bounded(driver.shutdown, 120)
    print(f"killed scheduler reported in {elapsed:.2f} s")


def test_scheduler_killed_inside_a_switch_breaks_the_pool(tiny_models):
    """Rank 1 is held in the KV hand-off (an injected hang) and SIGKILLed there: the switch RPC notices the dead
    process at its next slice, far inside its deadline (600 s here), and the pool is broken naming rank 1 and
    the call; every request fails with it; shutdown completes."""
    from pat_rollout.driver import RolloutDriver
    from pat_rollout.driver.errors import PoolBrokenError
    from pat_rollout.sglang import rank_rpc

    driver = RolloutDriver(_config(tiny_models["llama"], rpc_timeout_s=600.0))
    try:
        reqs = _requests("kill2-", max_new=400)
        futures = {r.request_id: driver.submit(r) for r in reqs}
        _wait_tokens(driver, futures, 4)
        driver.pool.fail_next("kv", rank=1, hang_s=600)
        box: dict = {}
        switch = threading.Thread(target=lambda: box.setdefault("r", _catch(lambda: driver.reconfigure(2))),
                                  daemon=True)
        switch.start()
        t0 = time.monotonic()
        while rank_rpc.read_phase(os.path.join(driver.pool.workdir, f"pat_switch.{driver.pool._calls}"), 1) != "kv":
            if time.monotonic() - t0 > 60:
                pytest.fail("rank 1 never entered the KV hand-off")
            time.sleep(0.05)
        t0 = time.monotonic()
        os.kill(driver.pool.pids[1], signal.SIGKILL)
        switch.join(60)
        assert not switch.is_alive(), "reconfigure hung after the kill"
        elapsed = time.monotonic() - t0
        err = box["r"]
        assert isinstance(err, PoolBrokenError), err
        assert re.search(r"SGLang switch .* -> TP2: SglPool RPC pat_switch: the scheduler process of rank\(s\) "
                         r"\[(0, )?1\] died", str(err)), str(err)
        for f in futures.values():
            with pytest.raises(PoolBrokenError, match=r"rank\(s\) \[(0, )?1\] died"):
                f.result(timeout=30)
    finally:
        bounded(driver.shutdown, 120)
    print(f"scheduler killed inside a switch: pool broken {elapsed:.2f} s after the kill")


def _catch(fn):
    try:
        fn()
    except BaseException as e:
        return e
    return None
