"""The vLLM backend (`backend="vllm"`, see `pat_rollout.driver.backends`): one vLLM engine per replica of the
current layout (`pool.VllmPool`). Importing this module does not import vllm."""

from __future__ import annotations

from pat_rollout.config import PatRolloutConfig
from pat_rollout.kv.cost import HandoffCost
from pat_rollout.layout import Layout
from pat_rollout.types import ModelSpec
from pat_rollout.vllm.pool import VllmPool, check_model

# Built from published figures (profile/data); no GPU run has measured one yet.
DEFAULT_PROFILE = "h100_llama31_8b"


def model_spec(config: PatRolloutConfig) -> ModelSpec:
    return check_model(config)


def build_pool(config: PatRolloutConfig, spec: ModelSpec, base: Layout, *, cost: HandoffCost | None,
               num_cpus_per_worker: float) -> VllmPool:
    # num_cpus_per_worker is for Ray actors; vLLM starts and places its own engine-core and worker processes.
    return VllmPool(config, spec, base, cost=cost)
