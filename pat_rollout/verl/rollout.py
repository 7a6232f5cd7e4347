"""`ServerAdapter(BaseRollout)`: the trainer-side half of the pat rollout, one per trainer rank.

Hybrid mode: verl calls `resume(["weights"])`, `update_weights(generator, global_steps=...)`, then
`resume(["kv_cache"])` on every rank; `release()` frees the pool's memory. Only the pool leader (infer-TP rank 0
of its replica) talks to the replica's PatServer; every rank iterates the weight generator because producing
full tensors (`DTensor.full_tensor()`) is collective in FSDP.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Generator
from typing import Any

import torch
from verl.workers.rollout.base import BaseRollout

from pat_rollout.verl.replica import server_actor_name

logger = logging.getLogger(__name__)


class ServerAdapter(BaseRollout):
    """Forwards memory and weight-sync calls of one trainer rank to its replica's PatServer."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any = None, replica_rank: int = -1,
                 *args: Any, **kwargs: Any) -> None:
        super().__init__(config, model_config, device_mesh)
        cfg = self.config
        world_size = cfg.tensor_model_parallel_size * cfg.data_parallel_size * cfg.pipeline_model_parallel_size
        rank = int(os.environ.get("RANK", "0"))
        self.replica_rank = rank // world_size if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % world_size
        if device_mesh is not None and "infer_tp" in (device_mesh.mesh_dim_names or ()):
            self.is_leader_rank = device_mesh["infer_tp"].get_local_rank() == 0
        else:
            self.is_leader_rank = self.rollout_rank == 0
        self.bucket_bytes = int(cfg.checkpoint_engine.update_weights_bucket_megabytes) << 20
        self._server: Any = None

    def _server_handle(self) -> Any:
        if self._server is None:
            import ray

            name = server_actor_name(self.replica_rank)
            try:
                self._server = ray.get_actor(name)
            except ValueError as e:
                e.add_note(f"ServerAdapter replica_rank={self.replica_rank} rollout_rank={self.rollout_rank}: "
                           f"PatServer actor {name!r} not found; was the PatReplica launched?")
                raise
        return self._server

    async def resume(self, tags: list[str]) -> None:
        if self.is_leader_rank:
            await self._server_handle().resume.remote(list(tags))

    async def release(self) -> None:
        if self.is_leader_rank:
            await self._server_handle().release.remote(["weights", "kv_cache"])

    async def update_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                             wire_format: str = "named_tensors", global_steps: int | None = None,
                             **kwargs: Any) -> None:
        """Iterate `weights` (on every rank) and, on the leader, send full CPU tensors in buckets of
        `checkpoint_engine.update_weights_bucket_megabytes`."""
        if wire_format != "named_tensors":
            raise NotImplementedError(f"pat rollout supports wire_format='named_tensors' only, got {wire_format!r}")
        if kwargs.get("peft_config") is not None and kwargs.get("base_sync_done"):
            raise NotImplementedError("pat rollout cannot serve LoRA adapters; merge LoRA weights before sync")
        server = self._server_handle() if self.is_leader_rank else None
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        num_tensors = 0
        for name, tensor in weights:  # every rank iterates: producing full tensors is collective
            if server is None:
                continue
            t = tensor.detach().to("cpu")
            bucket.append((name, t))
            size += t.numel() * t.element_size()
            num_tensors += 1
            if size >= self.bucket_bytes:
                await server.update_weights.remote(bucket)
                bucket, size = [], 0
        if server is None:
            return
        if bucket:
            await server.update_weights.remote(bucket)
        await server.set_global_steps.remote(global_steps)
        logger.info("pat ServerAdapter replica %d: sent %d tensors (global_steps=%s)", self.replica_rank,
                    num_tensors, global_steps)
