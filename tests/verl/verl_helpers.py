"""Shared pieces of the verl integration tests: Hydra compose of verl's ppo_trainer config, and verl's
LLMServerManager over dummy CPU trainer workers with PatReplica's driver swapped."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest


def compose_ppo(overrides: list[str], config_dir: str | None = None, config_name: str = "ppo_trainer"):
    """Compose verl's trainer config (or a plug-in YAML that builds on it) with Hydra overrides."""
    from hydra import compose, initialize_config_dir

    verl = pytest.importorskip("verl")
    config_dir = config_dir or os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name=config_name, overrides=overrides)


@contextlib.contextmanager
def pat_server_manager(cfg: Any, driver_factory: Callable, num_workers: int, name_prefix: str) -> Iterator[Any]:
    """verl's LLMServerManager.create over `num_workers` dummy trainer workers (one per "GPU", standing in
    for ActorRolloutRefWorker), with PatReplica building `driver_factory` drivers. On exit the servers, the
    load balancer, the workers and their placement groups are torn down."""
    import ray
    from ray.util.placement_group import remove_placement_group
    from verl.single_controller.base import Worker
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.workers.rollout.llm_server import LLMServerManager

    from pat_rollout.verl.replica import PatReplica

    class DummyTrainerWorker(Worker):
        pass

    pool = RayResourcePool([num_workers], use_gpu=False, max_colocate_count=1)
    wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(DummyTrainerWorker)),
                        name_prefix=name_prefix, device_name="cpu")
    old_factory = PatReplica.driver_factory
    PatReplica.driver_factory = driver_factory
    try:
        manager = LLMServerManager.create(config=cfg, worker_group=wg)
    finally:
        PatReplica.driver_factory = old_factory
    try:
        yield manager
    finally:
        replicas = manager.get_replicas()

        async def shutdown():
            await asyncio.gather(*[r.shutdown() for r in replicas])

        asyncio.run(shutdown())
        for handle in [*(r.server_handle for r in replicas), manager.global_load_balancer, *wg.workers]:
            ray.kill(handle)
        for pg in pool.get_placement_groups():
            remove_placement_group(pg)
