"""Latency profiles: decode-step time per (tp, batch, context) and reconfiguration costs, as versioned JSON.

`model.py` is pure stdlib (the planner depends on it). Builtin profiles live in `data/`; the published-figure
ones are built by `published.py` (pure). A profiler that measures a real engine writes the same schema; `gpu.py`
(torch, run as `python -m pat_rollout.profile.gpu`) times one rank's decode step at TP-k shard shapes on one GPU
and writes it too. This package must not import torch, ray or sglang at import time.
"""

from pat_rollout.profile.model import BUILTIN_PROFILES, LatencyModel, ProfileModelShape

__all__ = ["BUILTIN_PROFILES", "LatencyModel", "ProfileModelShape"]
