"""How the driver gets a pool without knowing any backend: `get_backend(config.backend)` imports the backend's
module named in `config.BACKEND_MODULES` (only when asked: the reference path never imports sglang) and the driver
calls its `model_spec` and `build_pool`; after that it talks only to the `driver.pool.Pool` protocol. Adding a
backend is a new package with a `backend` module plus one line in `BACKEND_MODULES`, and no driver code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Protocol, cast

from pat_rollout.config import BACKEND_MODULES, PatRolloutConfig

if TYPE_CHECKING:
    from pat_rollout.driver.pool import Pool
    from pat_rollout.kv.cost import HandoffCost
    from pat_rollout.layout import Layout
    from pat_rollout.types import ModelSpec


class Backend(Protocol):
    """What a backend's `backend` module defines."""

    DEFAULT_PROFILE: str  # the latency profile the planner uses when config.profile_path is unset

    def model_spec(self, config: PatRolloutConfig) -> ModelSpec:
        """Check the checkpoint and the TP sizes against each other and return the model's spec. Starts nothing,
        so a bad model fails before any process or actor starts."""
        ...

    def build_pool(self, config: PatRolloutConfig, spec: ModelSpec, base: Layout, *, cost: HandoffCost | None,
                   num_cpus_per_worker: float) -> Pool:
        """Start `config.num_devices` devices in layout `base` and return their pool. `cost` is the hand-off cost
        model (None: the pool's default); `num_cpus_per_worker` is what one device's Ray actor reserves, for
        backends that start Ray actors."""
        ...


def get_backend(name: str) -> Backend:
    """The backend `name` (a `PatRolloutConfig.backend`, validated there)."""
    return cast(Backend, importlib.import_module(BACKEND_MODULES[name]))
