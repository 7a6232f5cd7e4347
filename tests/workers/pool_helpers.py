"""Helpers for driver tests: skewed batches, pool configs and hand-made latency profiles."""

from __future__ import annotations

import json
import random
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
    """A hand-made profile in which `fast_tp` decodes a small batch 4x faster and costs almost nothing to
    switch to: the planner must pick it once the batch drains."""
    decode = []
    for tp in tps:
        for batch in (1, 8):
            for context in (8, 256):
                step = 0.01 * (batch if tp != fast_tp else batch * 0.25 + 0.5 * (batch > 1) * batch)
                decode.append({"tp": tp, "batch": batch, "context": context, "step_s": step})
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


