"""One device's worker: a TP shard of the reference engine plus the per-actor side of PAT's
reconfiguration (export, KV hand-off, in-place reshard, group switch, import).

Plain Python (no ray import) so it can be unit-tested in-process; `group.py` wraps it in a Ray actor.
Every method that communicates is called on all devices at once by the driver.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pat_rollout.comm.groups import GroupCache
from pat_rollout.comm.tp_context import TPContext
from pat_rollout.comm.transport import GlooTransport, TransferTimeout
from pat_rollout.engine.base import EngineSnapshot, StepResult
from pat_rollout.engine.ref.config import RefEngineConfig
from pat_rollout.engine.ref.engine import RefEngine
from pat_rollout.engine.ref.loader import load_tensors, map_hf_name
from pat_rollout.kv.apply import gather_kv
from pat_rollout.kv.plan import KVPlan, KVTransfer
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
    comm_timeout_s: float = 1800.0  # every collective and transfer; a blocked peer errors out after this
    transfer_timeout_floor_s: float = 5.0  # a KV hand-off or reshard step waits floor + bytes / min rate, at most
    transfer_min_bytes_per_s: float = 100e6  # comm_timeout_s (comm.transport.TransferTimeout)
    transfer_chunk_bytes: int = 64 << 20  # scratch bound of one transfer round (reshard_local, gather_kv)


FAULT_PHASES = ("export", "kv", "reshard", "switch", "import", "step", "rollback", "release", "weights")


class ShardWorker:
    def __init__(self, init: WorkerInit) -> None:
        self.device = init.device
        self.init = init
        torch.set_num_threads(init.num_threads)
        self.layout = init.initial_layout
        self.base = init.initial_layout
        self._join(init.init_method)
        self.engine = RefEngine(init.engine, self._tp_context(self.layout))
        self._exported: dict[str, RequestState] = {}
        self._incoming_kv: dict[str, torch.Tensor] = {}
        self._kv_bytes_received = 0
        self._new_shards: dict[str, torch.Tensor] | None = None
        self._fail: tuple[str, float] | None = None  # fault injection for tests: (phase, hang seconds or 0)
        # Host copy of this device's base-layout shard: what a failed reconfiguration or weight load rolls back to
        # (SGLang keeps the same backup under verl: enable_weights_cpu_backup). Taken once here; each weight update
        # then writes its tensors' base-layout slices into it (commit_weights), whatever layout it loads into.
        self._backup = {name: t.detach().to("cpu", copy=True) for name, t in self.engine.named_shards().items()}
        self._pending_backup: dict[str, torch.Tensor] = {}
        self.num_comm_builds = 1

    def _join(self, init_method: str) -> None:
        """Join the torch.distributed world and build every reachable layout's group, all with the timeout."""
        timeout = datetime.timedelta(seconds=self.init.comm_timeout_s)
        if not dist.is_initialized():
            dist.init_process_group(self.init.backend, init_method=init_method, rank=self.device,
                                    world_size=self.init.world_size, timeout=timeout)
        self.groups = GroupCache(self.init.backend, timeout=timeout)
        self.groups.build(reachable_layouts(self.base, self.init.tp_sizes))
        self.transport = GlooTransport(group=None, device_to_group_rank=None, timeout=TransferTimeout(
            floor_s=self.init.transfer_timeout_floor_s, min_bytes_per_s=self.init.transfer_min_bytes_per_s,
            max_s=self.init.comm_timeout_s))

    def rebuild_comm(self, init_method: str, rebind: bool = True) -> None:
        """Tear down and rebuild every process group (a timed-out gloo transfer leaves its pairs closed).
        Collective over the world at a fresh rendezvous `init_method`; with `rebind` the (idle) engine is
        bound to the new group of its layout."""
        self.groups.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        self._join(init_method)
        self.num_comm_builds += 1
        if rebind:
            self.engine.set_layout(self._tp_context(self.layout), None)

    # ---- set-up ---------------------------------------------------------------------------------
    def _tp_context(self, layout: Layout) -> TPContext:
        replica, rank = layout.position(self.device)
        devices = layout.groups[replica]
        handle = self.groups.get(devices)
        return TPContext(rank=rank, size=len(devices), group=handle.pg, global_ranks=devices)

    def info(self) -> dict[str, Any]:
        return {"device": self.device, "pid": os.getpid(), "layout": str(self.layout),
                "num_groups": len(self.groups), "groups_created": self.groups.num_created,
                "group_ids": {str(sorted(k)): id(h.pg) for k, h in self.groups.handles().items()},
                "num_comm_builds": self.num_comm_builds,
                "engine_stats": dict(self.engine.stats), "num_unfinished": self.engine.num_unfinished()}

    def fail_next(self, phase: str | None, hang_s: float = 0.0) -> None:
        """Test hook: in the next call of phase `phase` (one of FAULT_PHASES) raise, or with `hang_s` > 0
        sleep that long first (a hung device)."""
        if phase is not None and phase not in FAULT_PHASES:
            raise ValueError(f"fail_next: phase={phase!r} is not one of {FAULT_PHASES}")
        self._fail = None if phase is None else (phase, hang_s)

    def _maybe_fail(self, phase: str) -> None:
        if self._fail is not None and self._fail[0] == phase:
            hang_s = self._fail[1]
            self._fail = None
            if hang_s > 0:
                time.sleep(hang_s)
            raise RuntimeError(f"injected failure in phase {phase!r} on device {self.device}")

    # ---- serving --------------------------------------------------------------------------------
    def add_requests(self, requests: list[Request]) -> None:
        self.engine.add_requests(requests)

    def step(self, num_steps: int) -> tuple[StepResult, EngineSnapshot]:
        self._maybe_fail("step")
        result = self.engine.step(num_steps)
        return result, self.engine.snapshot()

    def abort_all(self) -> list[RequestOutput]:
        return self.engine.abort_all()

    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Load full HF-named tensors (one bucket) into this device's shard of the current layout, and stage their
        slices of the base layout for the host backup (commit_weights writes them once every device loaded).
        A failure leaves the engine part-loaded: the driver rolls every device back to the base layout from the
        backup, which still holds this bucket's previous weights on every device."""
        _, base_rank = self.base.position(self.device)
        specs = self.engine.shard_specs
        staged = {name: self._backup[name].clone() for name in {map_hf_name(n)[0] for n, _ in named_tensors}
                  if name in specs}
        load_tensors(staged, specs, named_tensors, base_rank, self.base.tp_size, require_all=False)
        self.engine.update_weights(named_tensors)
        self._maybe_fail("weights")
        self._pending_backup = staged

    def commit_weights(self) -> None:
        """Every device loaded the bucket: its base-layout slices become the rollback target."""
        self._backup.update(self._pending_backup)
        self._pending_backup = {}

    def weight_shards(self) -> dict[str, dict[str, torch.Tensor]]:
        """Copies of this device's weights, for tests: "engine", its shard of the current layout, and "backup",
        the host backup of its base-layout shard."""
        return {"engine": {n: t.clone() for n, t in self.engine.named_shards().items()},
                "backup": {n: t.clone() for n, t in self._backup.items()}}

    def release(self, tags: list[str]) -> None:
        self.engine.release(tags)

    def resume(self, tags: list[str]) -> None:
        self.engine.resume(tags)

    # ---- reconfiguration phases (called on every device, in this order) ------------------------
    def export_requests(self, request_ids: list[str] | None = None) -> list[RequestState]:
        """Lift out every unfinished request (a reconfiguration), or only `request_ids` (a rebalance moves a
        few)."""
        self._maybe_fail("export")
        states = self.engine.export_requests(request_ids)
        self._exported = {s.request_id: s for s in states}
        return states

    def handoff_kv(self, transfers: KVPlan | tuple[KVTransfer, ...]) -> float:
        """Send/receive KV of migrated requests; returns seconds spent."""
        t0 = time.perf_counter()
        spec = self.engine.model_spec
        with self._transfer_step():
            self._maybe_fail("kv")
            self._incoming_kv = gather_kv(transfers, self.device, self._export_kv, self.transport,
                                          num_layers=spec.num_layers, head_dim=spec.head_dim, dtype=self.engine.dtype,
                                          chunk_bytes=self.init.transfer_chunk_bytes)
        elem = torch.tensor([], dtype=self.engine.dtype).element_size()
        mine = transfers.transfers if isinstance(transfers, KVPlan) else transfers
        self._kv_bytes_received = sum(spec.num_layers * 2 * t.num_tokens * t.num_heads * spec.head_dim * elem
                                      for t in mine if t.dst_device == self.device and not t.is_local)
        return time.perf_counter() - t0

    def _export_kv(self, request_id: str, kv_heads: tuple[int, int], tokens: tuple[int, int]) -> torch.Tensor:
        """Tokens [t0, t1) of an exported request's KV heads (the engine reads the request's KV, then this slices)."""
        return self.engine.export_kv(request_id, kv_heads)[:, :, tokens[0] : tokens[1]]

    def reshard(self, plan: Any) -> float:
        """Free the old KV, then reshard weights in place (grow) or with transfers (shrink)."""
        t0 = time.perf_counter()
        with self._transfer_step():
            self._maybe_fail("reshard")
            self.engine.free_exported()
            self._new_shards = reshard_local(self.engine.named_shards(), plan, self.device, self.transport,
                                             chunk_bytes=self.init.transfer_chunk_bytes)
        return time.perf_counter() - t0

    @contextlib.contextmanager
    def _transfer_step(self) -> Iterator[None]:
        """A failure here aborts this device's transport, so peers waiting for its messages fail within
        milliseconds instead of at their timeout; the driver's rollback then rebuilds every group."""
        try:
            yield
        except Exception:
            self.transport.abort()
            raise

    def switch(self, layout: Layout) -> float:
        """Bind the engine to the cached group of `layout` and re-create its KV pool."""
        t0 = time.perf_counter()
        self._maybe_fail("switch")
        self.engine.set_layout(self._tp_context(layout), self._new_shards)
        self._new_shards = None
        self.layout = layout
        return time.perf_counter() - t0

    def import_requests(self, states: list[RequestState], migrated: Iterable[str]) -> dict[str, Any]:
        """Import `states` (those in `migrated` with their handed-off KV); reports what the engine did:
        seconds, requests resumed from KV, ids recomputed for lack of blocks, KV bytes received."""
        t0 = time.perf_counter()
        self._maybe_fail("import")
        kv = {rid: self._incoming_kv[rid] for rid in migrated}
        fallbacks = self.engine.import_requests(states, kv or None)
        self._incoming_kv.clear()
        self._exported.clear()
        received, self._kv_bytes_received = self._kv_bytes_received, 0
        return {"seconds": time.perf_counter() - t0, "num_with_kv": len(kv) - len(fallbacks),
                "fallbacks": tuple(fallbacks), "kv_bytes_received": received}

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

    def rollback(self, layout: Layout, init_method: str | None = None) -> list[RequestState]:
        """Return to the base `layout` after a failed reconfiguration or weight load, restoring this device's shard
        from the host backup (and rebuilding every process group at `init_method` when given: a failed
        transfer may have closed them). Returns every unfinished request this device held: its exports,
        or, if its export never ran, what its engine still had; the driver re-imports them for recomputation."""
        if layout != self.base:
            raise ValueError(f"rollback target {layout} is not the base layout {self.base}")
        self._maybe_fail("rollback")
        held = list(self._exported.values()) or self.engine.export_requests(None)
        self._incoming_kv.clear()
        self._kv_bytes_received = 0
        self._new_shards = None
        self._pending_backup = {}
        self.engine.free_exported()
        self._exported.clear()
        self.engine.abort_all()  # anything imported before the failure is re-imported by the driver
        self.layout = layout
        if init_method is not None:
            self.rebuild_comm(init_method, rebind=False)
        shards = {name: t.clone() for name, t in self._backup.items()}
        self.engine.set_layout(self._tp_context(layout), shards)
        return held

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
