"""Latency profiles: decode-step time per (tp, batch, context) and reconfiguration costs, as versioned JSON.

`model.py` is pure stdlib (the planner depends on it). Builtin profiles live in `data/`; the published-figure
ones are built by `published.py` (pure). A profiler that
measures a real engine writes the same schema. This package must not import torch, ray or sglang at import time.
"""

from pat_rollout.profile.model import BUILTIN_PROFILES, LatencyModel, ProfileModelShape

__all__ = ["BUILTIN_PROFILES", "LatencyModel", "ProfileModelShape"]
