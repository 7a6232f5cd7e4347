"""Helpers for driver tests: skewed batches, pool configs and hand-made latency profiles."""

from __future__ import annotations

import random
import threading
import time

import pytest
from profile_helpers import write_profile  # noqa: F401  (re-exported: tests import it from here)

from pat_rollout.config import PatRolloutConfig
from pat_rollout.types import Request, SamplingParams


def skewed_requests(n: int = 6, long_len: int = 48, short_len: int = 6, seed: int = 0, vocab: int = 250,
                    temperature: float = 0.0) -> list[Request]:
    """Two long requests and n-2 short ones (ignore_eos so lengths are exactly controlled)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = tuple(rng.randrange(3, vocab) for _ in range(rng.randrange(4, 12)))
        length = long_len if i < 2 else short_len + i
        out.append(Request(request_id=f"r{i}", prompt_token_ids=prompt,
                           sampling=SamplingParams(max_new_tokens=length, ignore_eos=True, temperature=temperature,
                                                   top_p=0.9 if temperature else 1.0, seed=1000 + i)))
    return out


def pool_config(model_path: str, **kw) -> PatRolloutConfig:
    base = dict(model_path=model_path, num_devices=2, dtype="float64", num_kv_blocks=64, block_size=4,
                steps_per_poll=2, policy="manual", initial_tp=1)
    base.update(kw)
    return PatRolloutConfig(**base)


def bounded(fn, seconds: float = 60):
    """fn() in a thread; its result or exception, or a test failure if it is still running after `seconds`."""
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


def wait_first_done(futures, timeout: float = 120) -> None:
    """Block until some request has finished: the long ones are then still mid-decode."""
    t0 = time.time()
    while not any(f.done() for f in futures):
        assert time.time() - t0 < timeout, "no request finished"
        time.sleep(0.005)


def one_replica_long(requests: list[Request], num_replicas: int, num_long: int = 2) -> list[Request]:
    """Reorder so least-inflight dispatch (replica 0, 1, ..., num_replicas - 1, 0, ...) puts the first
    `num_long` requests (the long ones of `skewed_requests`) all on replica 0."""
    longs, shorts = list(requests[:num_long]), list(requests[num_long:])
    out = []
    while longs or shorts:
        out.append(longs.pop(0) if len(out) % num_replicas == 0 and longs else shorts.pop(0))
    return out
