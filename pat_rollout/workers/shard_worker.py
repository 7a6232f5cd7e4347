"""One device's worker: a TP shard of the reference engine plus the per-actor side of PAT's
reconfiguration (export, KV hand-off, in-place reshard, group switch, import).

Plain Python (no ray import) so it can be unit-tested in-process; `group.py` wraps it in a Ray actor.
Every method that communicates is called on all devices at once by the driver.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pat_rollout.comm.groups import GroupCache
from pat_rollout.comm.tp_context import TPContext
from pat_rollout.comm.transport import GlooTransport
from pat_rollout.engine.base import EngineSnapshot, StepResult
from pat_rollout.engine.ref.config import RefEngineConfig
from pat_rollout.engine.ref.engine import RefEngine
from pat_rollout.kv.apply import gather_kv
from pat_rollout.kv.plan import KVTransfer
from pat_rollout.layout import Layout
from pat_rollout.layout.reachable import reachable_layouts
from pat_rollout.reshard.apply import reshard_local
from pat_rollout.types import Request, RequestOutput, RequestState

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerInit:
    """Everything a worker needs to join the pool."""

    device: int
    world_size: int
    init_method: str  # torch.distributed rendezvous, e.g. tcp://127.0.0.1:29500
    engine: RefEngineConfig
    initial_layout: Layout
    tp_sizes: tuple[int, ...]
    backend: str = "gloo"
    num_threads: int = 1


class ShardWorker:
    def __init__(self, init: WorkerInit) -> None:
        self.device = init.device
        torch.set_num_threads(init.num_threads)
        if not dist.is_initialized():
            dist.init_process_group(init.backend, init_method=init.init_method, rank=init.device,
                                    world_size=init.world_size)
        self.groups = GroupCache(init.backend)
        self.groups.build(reachable_layouts(init.initial_layout, init.tp_sizes))
        self.layout = init.initial_layout
        self.base = init.initial_layout
        self.engine = RefEngine(init.engine, self._tp_context(self.layout))
        self.transport = GlooTransport(group=None, device_to_group_rank=None)
        self._exported: dict[str, RequestState] = {}
        self._incoming_kv: dict[str, torch.Tensor] = {}
        self._new_shards: dict[str, torch.Tensor] | None = None
        self._fail_phase: str | None = None  # fault injection for tests
        self._backup_base_weights()

    # ---- set-up ---------------------------------------------------------------------------------
    def _tp_context(self, layout: Layout) -> TPContext:
        replica, rank = layout.position(self.device)
        devices = layout.groups[replica]
        handle = self.groups.get(devices)
        return TPContext(rank=rank, size=len(devices), group=handle.pg, global_ranks=devices)

    def info(self) -> dict[str, Any]:
        return {"device": self.device, "pid": os.getpid(), "layout": str(self.layout),
                "num_groups": len(self.groups), "groups_created": self.groups.num_created,
                "group_ids": {str(sorted(k)): id(h.pg) for k, h in self.groups.handles().items()}}

    def fail_next(self, phase: str | None) -> None:
        """Test hook: raise inside the next call of reconfiguration phase `phase`."""
        self._fail_phase = phase

    def _maybe_fail(self, phase: str) -> None:
        if self._fail_phase == phase:
            self._fail_phase = None
            raise RuntimeError(f"injected failure in phase {phase!r} on device {self.device}")

    # ---- serving --------------------------------------------------------------------------------
    def add_requests(self, requests: list[Request]) -> None:
        self.engine.add_requests(requests)

    def step(self, num_steps: int) -> tuple[StepResult, EngineSnapshot]:
        result = self.engine.step(num_steps)
        return result, self.engine.snapshot()

    def abort_all(self) -> list[RequestOutput]:
        return self.engine.abort_all()

    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        if self.layout != self.base:
            raise RuntimeError(f"device {self.device}: update_weights in layout {self.layout}; the driver must "
                               f"return to the base layout {self.base} first")
        self.engine.update_weights(named_tensors)
        self._backup_base_weights()

    def _backup_base_weights(self) -> None:
        """Host copy of this device's base-layout shard: what a failed reconfiguration rolls back to
        (SGLang keeps the same backup under verl: enable_weights_cpu_backup)."""
        self._backup = {name: t.detach().to("cpu", copy=True) for name, t in self.engine.named_shards().items()}

    def release(self, tags: list[str]) -> None:
        self.engine.release(tags)

    def resume(self, tags: list[str]) -> None:
        self.engine.resume(tags)

    # ---- reconfiguration phases (called on every device, in this order) ------------------------
    def export_requests(self, request_ids: list[str] | None = None) -> list[RequestState]:
        """Lift out every unfinished request, or only `request_ids` (a rebalance moves a few)."""
        self._maybe_fail("export")
        states = self.engine.export_requests(request_ids)
        self._exported = {s.request_id: s for s in states}
        return states

    def handoff_kv(self, transfers: tuple[KVTransfer, ...]) -> float:
        """Send/receive KV of migrated requests; returns seconds spent."""
        t0 = time.perf_counter()
        self._maybe_fail("kv")
        spec = self.engine.model_spec
        self._incoming_kv = gather_kv(transfers, self.device, self.engine.export_kv, self.transport,
                                      num_layers=spec.num_layers, head_dim=spec.head_dim, dtype=self.engine.dtype)
        return time.perf_counter() - t0

    def reshard(self, plan: Any) -> float:
        """Free the old KV, then reshard weights in place (grow) or with transfers (shrink)."""
        t0 = time.perf_counter()
        self._maybe_fail("reshard")
        self.engine.free_exported()
        self._new_shards = reshard_local(self.engine.named_shards(), plan, self.device, self.transport)
        return time.perf_counter() - t0

    def switch(self, layout: Layout) -> float:
        """Bind the engine to the cached group of `layout` and re-create its KV pool."""
        t0 = time.perf_counter()
        self._maybe_fail("switch")
        self.engine.set_layout(self._tp_context(layout), self._new_shards)
        self._new_shards = None
        self.layout = layout
        return time.perf_counter() - t0

    def import_requests(self, states: list[RequestState], migrated: Iterable[str]) -> float:
        t0 = time.perf_counter()
        self._maybe_fail("import")
        kv = {rid: self._incoming_kv[rid] for rid in migrated}
        self.engine.import_requests(states, kv or None)
        self._incoming_kv.clear()
        self._exported.clear()
        return time.perf_counter() - t0

    # ---- rebalance (workers/rebalance.py): export + handoff_kv + import above, plus these two ---------
    def release_exported(self) -> None:
        """Free the KV blocks of the requests exported to another replica (their KV has been handed off)."""
        self._maybe_fail("release")
        self.engine.free_exported()
        self._exported.clear()

    def drop_requests(self, request_ids: list[str]) -> list[RequestState]:
        """Rollback of a failed rebalance: remove `request_ids` wherever they are on this device (exported,
        running or waiting), free their KV and return their states; the driver re-imports them."""
        self._incoming_kv.clear()
        wanted = set(request_ids)
        live = [s.request_id for s in (*self.engine.scheduler.running, *self.engine.scheduler.waiting)
                if s.request_id in wanted]
        dropped = [s for rid, s in self._exported.items() if rid in wanted]
        dropped += self.engine.export_requests(live) if live else []
        self.engine.free_exported()
        self._exported.clear()
        return dropped

    def rollback(self, layout: Layout) -> None:
        """Return to the base `layout` after a failed reconfiguration, restoring this device's shard from
        the host backup; the driver then re-imports every exported request for recomputation."""
        if layout != self.base:
            raise ValueError(f"rollback target {layout} is not the base layout {self.base}")
        self._incoming_kv.clear()
        self._new_shards = None
        if self._exported:
            self.engine.free_exported()
            self._exported.clear()
        self.engine.abort_all()  # anything imported before the failure is re-imported by the driver
        shards = {name: t.clone() for name, t in self._backup.items()}
        self.engine.set_layout(self._tp_context(layout), shards)
        self.layout = layout

    def measure_p2p(self, nbytes: int, src: int, dst: int, repeats: int = 3) -> float:
        """Seconds per one-way message of `nbytes` from `src` to `dst` (profiling KV bandwidth)."""
        buf = torch.empty(max(1, nbytes // 4), dtype=torch.float32)
        if self.device not in (src, dst):
            return 0.0
        for i in range(repeats + 1):
            if i == 1:  # the first message is a warm-up (connection set-up)
                t0 = time.perf_counter()
            if self.device == src:
                dist.send(buf, dst)
            else:
                dist.recv(buf, src)
        return (time.perf_counter() - t0) / repeats

    def shutdown(self) -> None:
        self.groups.close()
        if dist.is_initialized():
            dist.destroy_process_group()
