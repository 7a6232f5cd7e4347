"""Hand-made latency profiles for tests in which the planner must (or must not) switch."""

from __future__ import annotations

import json
from pathlib import Path

from pat_rollout.profile.model import LatencyModel


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


def linear_profile(tp2_scale: float = 1.0) -> LatencyModel:
    """Decode steps linear in batch, independent of context (TP2's scaled by `tp2_scale`: 3 = a wrong profile)."""
    decode = [{"tp": tp, "batch": b, "context": c,
               "step_s": 0.010 + 0.004 * b if tp == 1 else (0.006 + 0.003 * b) * tp2_scale}
              for tp in (1, 2) for b in (1, 2, 4, 8, 16) for c in (8, 2048)]
    return LatencyModel.from_dict({
        "schema_version": 1,
        "meta": {"hardware": "test", "model": "tiny", "backend": "reference", "source": "measured", "notes": "x"},
        "model": {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
                  "param_bytes": 1000, "dtype_bytes": 8},
        "decode": decode, "prefill": [{"tp": tp, "tokens_per_s": 1e6, "fixed_s": 0.0} for tp in (1, 2)],
        "kv_transfer": {"bandwidth_bytes_per_s": 1e9, "latency_s": 1e-5},
        "reshard": {"bandwidth_bytes_per_s": 1e9, "fixed_s": 1e-4}, "group_switch_s": 0.05})
