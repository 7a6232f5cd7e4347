"""Register `actor_rollout_ref.rollout.name=pat` in verl's two rollout registries.

Imported by `import verl` through the `verl.plugins` entry point (setup.py), in every process that imports verl
(driver, TaskRunner, trainer workers, agent-loop workers). It runs while `verl/__init__` is still executing, so
it imports only verl's registry modules and refers to our classes by name (loaded lazily on first use).
verl swallows plug-in import errors at DEBUG level; we log them at ERROR before re-raising so they are seen.
With `VERL_PLATFORM=cpu` (and only then) it also installs pat_rollout's CPU platform for verl's trainer
(`pat_rollout.verl.cpu_platform`), so `python -m verl.trainer.main_ppo` runs on a host without accelerators.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

NAME = "pat"
SERVER_ADAPTER = "pat_rollout.verl.rollout.ServerAdapter"


def _load_pat_replica():
    from pat_rollout.verl.replica import PatReplica

    return PatReplica


def register() -> None:
    """Idempotently add `pat` to `_ROLLOUT_REGISTRY` (trainer-side adapter) and `RolloutReplicaRegistry`."""
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    _ROLLOUT_REGISTRY[(NAME, "async")] = SERVER_ADAPTER
    RolloutReplicaRegistry.register(NAME, _load_pat_replica)
    from pat_rollout.verl import cpu_platform

    if cpu_platform.enabled():
        cpu_platform.install()


try:
    register()
except Exception:
    logger.exception("pat_rollout: registering rollout.name=%r with verl failed", NAME)
    raise
