"""The SGLang backend (`backend="sglang"`, see `pat_rollout.backends`): one SGLang engine whose scheduler ranks
serve as the replicas of the current layout (`pool.SglPool`). Importing this module does not import sglang."""

from __future__ import annotations

from pat_rollout.config import PatRolloutConfig
from pat_rollout.kv.cost import HandoffCost
from pat_rollout.layout import Layout
from pat_rollout.sglang.pool import SglPool, check_model
from pat_rollout.types import ModelSpec

# Built from published figures (profile/data); no GPU run has measured one yet.
DEFAULT_PROFILE = "h100_llama31_8b"


def model_spec(config: PatRolloutConfig) -> ModelSpec:
    return check_model(config)


def build_pool(config: PatRolloutConfig, spec: ModelSpec, base: Layout, *, cost: HandoffCost | None,
               num_cpus_per_worker: float) -> SglPool:
    # num_cpus_per_worker is for Ray actors; SGLang starts and places its own scheduler processes.
    return SglPool(config, spec, base, cost=cost)
