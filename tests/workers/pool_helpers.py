"""Helpers for driver tests: skewed batches, pool configs and hand-made latency profiles."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

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


def write_profile(path: Path, *, tps=(1, 2), fast_tp: int = 2) -> str:
    """A hand-made profile in which `fast_tp` wins only on a small batch and switching costs almost
    nothing: the planner must pick it once the batch drains, not before."""
    # fast_tp: 5x faster on 1-2 requests, but 1.5x slower than 2 replicas of the other TP on a big batch.
    decode = []
    for tp in tps:
        for batch, slow, fast in ((1, 0.01, 0.002), (2, 0.02, 0.004), (8, 0.08, 0.12)):
            for context in (8, 256):
                decode.append({"tp": tp, "batch": batch, "context": context, "step_s": fast if tp == fast_tp else slow})
    profile = {
        "schema_version": 1,
        "meta": {"hardware": "test", "model": "tiny", "backend": "reference", "source": "measured",
                 "notes": "hand-made for tests"},
        "model": {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
                  "param_bytes": 1000, "dtype_bytes": 8},
        "decode": decode,
        "prefill": [{"tp": tp, "tokens_per_s": 1e6, "fixed_s": 0.0} for tp in tps],
        "kv_transfer": {"bandwidth_bytes_per_s": 1e9, "latency_s": 1e-5},
        "reshard": {"bandwidth_bytes_per_s": 1e9, "fixed_s": 1e-4},
        "group_switch_s": 1e-4,
    }
    path.write_text(json.dumps(profile))
    return str(path)




def wait_first_done(futures, timeout: float = 120) -> None:
    """Block until some request has finished: the long ones are then still mid-decode."""
    t0 = time.time()
    while not any(f.done() for f in futures):
        assert time.time() - t0 < timeout, "no request finished"
        time.sleep(0.005)
