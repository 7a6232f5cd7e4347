"""Helpers for the reference-engine tests (imported by name; pytest puts this folder on sys.path)."""

from __future__ import annotations

import random

from pat_rollout.comm.tp_context import TPContext
from pat_rollout.engine.ref import RefEngine, RefEngineConfig
from pat_rollout.types import Request, SamplingParams


def make_engine(model_path: str, tp: TPContext | None = None, **overrides) -> RefEngine:
    """A float64 RefEngine (ties impossible) with a 64-block cache unless overridden."""
    cfg = RefEngineConfig(**{"model_path": model_path, "dtype": "float64", "num_kv_blocks": 64, **overrides})
    return RefEngine(cfg, tp or TPContext())


def make_requests(lengths: list[int], max_new: list[int], prompt_seed: int = 0, prefix: str = "r",
                  **sampling) -> list[Request]:
    """Random prompts (ids 3..249, avoiding bos/eos/pad) of the given lengths."""
    rng = random.Random(prompt_seed)
    return [Request(request_id=f"{prefix}{i}", prompt_token_ids=tuple(rng.randrange(3, 250) for _ in range(n)),
                    sampling=SamplingParams(max_new_tokens=m, **sampling))
            for i, (n, m) in enumerate(zip(lengths, max_new))]
