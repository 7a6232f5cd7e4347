"""`RefPool`: the reference backend's pool, one Ray `ShardWorker` actor per device running the reference engine.
Built by `workers.backend`; the driver sees only the `Pool` protocol (`driver.pool`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from pat_rollout.driver.errors import PoolBrokenError, ReconfigurationError, WorkerError
from pat_rollout.driver.pool import Pool, RebalanceResult, ReconfigResult
from pat_rollout.engine.base import EngineSnapshot, StepResult
from pat_rollout.engine.ref.config import RefEngineConfig, check_request
from pat_rollout.layout import Layout
from pat_rollout.planner import EngineSpec, SchedulerModel
from pat_rollout.types import Request, RequestOutput
from pat_rollout.workers.rebalance import run_rebalance

__all__ = ["Pool", "RefPool"]


class RefPool(Pool):
    """The reference engine: one Ray `ShardWorker` actor per device, reconfigured by the `Reconfigurer`.
    Every call has a deadline `deadline(tokens)` from the tokens it may process (prefill + decode)."""

    supports_rebalance = True
    reports_load = True
    weights_in_any_layout = True

    def __init__(self, group: Any, reconfigurer: Any, base: Layout, engine: RefEngineConfig, *,
                 deadline: Callable[[int], float] | None = None, max_num_seqs: int = 256,
                 kv_capacity_tokens: int = 0) -> None:
        self.group = group  # workers.group.WorkerGroup
        self.reconfigurer = reconfigurer  # workers.reconfigure.Reconfigurer
        self.engine = engine
        self.num_devices = group.num_devices
        self.base = self.layout = base
        self.deadline = deadline or (lambda tokens: group.default_timeout_s)
        self.max_num_seqs = max_num_seqs
        self.kv_capacity_tokens = kv_capacity_tokens  # per device: bounds what a re-import recomputes
        self._prefill_tokens = 0  # tokens the next step may have to prefill (new and re-imported requests)
        self._comm_suspect = False  # a failed step may have left a peer's collective timed out

    def check_request(self, request: Request) -> None:
        check_request(request.request_id, request.prompt_token_ids, request.sampling.max_new_tokens,
                      self.reconfigurer.spec, self.engine)

    def add_requests(self, per_replica: dict[int, list[Request]]) -> None:
        calls = {d: ("add_requests", (reqs,)) for r, reqs in per_replica.items() for d in self.layout.groups[r]}
        self._prefill_tokens += sum(len(q.prompt_token_ids) for reqs in per_replica.values() for q in reqs)
        self.group.call_each(calls, what="add_requests", timeout=self.deadline(0))

    def step(self, replicas: Iterable[int], num_steps: int) -> dict[int, tuple[StepResult, EngineSnapshot]]:
        replicas = list(replicas)
        devices = [d for r in replicas for d in self.layout.groups[r]]
        work = self._prefill_tokens + num_steps * self.max_num_seqs
        try:
            out = self.group.call(devices, "step", num_steps, what="decode step", timeout=self.deadline(work))
        except WorkerError:
            self._comm_suspect = True
            raise
        self._prefill_tokens = 0
        results = dict(zip(devices, out))
        return {r: results[self.layout.groups[r][0]] for r in replicas}  # every TP rank returns the same

    def reconfigure(self, dst_tp: int, assignment: dict[str, int]) -> ReconfigResult:
        try:
            result = self.reconfigurer.run(self.layout, dst_tp, assignment)
        except ReconfigurationError:
            self.layout = self.base
            self._prefill_tokens += self.kv_capacity_tokens  # re-imported requests recompute their context
            raise
        self.layout = result.dst
        self._prefill_tokens += self.kv_capacity_tokens
        return result

    def rebalance(self, moves: dict[str, int], assignment: dict[str, int]) -> RebalanceResult:
        try:
            return run_rebalance(self.reconfigurer, self.layout, moves, assignment)
        finally:
            self._prefill_tokens += self.kv_capacity_tokens  # moved requests may recompute their context

    def abort_all(self) -> list[RequestOutput]:
        per_device = self.group.call(range(self.num_devices), "abort_all", what="abort", timeout=self.deadline(0))
        if self._comm_suspect:  # after a failed step: fresh communicators, so the next steps do not inherit it
            self.group.call(range(self.num_devices), "rebuild_comm", self.group.new_init_method(),
                            what="rebuilding process groups", timeout=self.deadline(0))
            self._comm_suspect = False
        self._prefill_tokens = 0
        return [out for group in self.layout.groups for out in per_device[group[0]]]

    def engine_spec(self) -> EngineSpec:
        """The reference scheduler's rules; a replica of any TP holds num_kv_blocks blocks (per rank, of its KV
        heads), so every layout's replica holds the same tokens."""
        e = self.engine
        scheduler = SchedulerModel(kind="ref", max_num_seqs=e.max_num_seqs, max_prefill_tokens=e.max_prefill_tokens,
                                   block_size=e.block_size)
        tokens = e.num_kv_blocks * e.block_size
        return EngineSpec(scheduler=scheduler, kv_tokens={tp: tokens for tp in range(1, self.num_devices + 1)
                                                          if self.num_devices % tp == 0})

    def update_weights(self, named_tensors: list[tuple[str, Any]]) -> None:
        """Load one bucket into the current layout on every device, then make it the rollback target (each
        device's host backup of its base-layout shard). If any device fails, every device rolls back to the base
        layout from the backup (this bucket's previous weights everywhere, earlier buckets kept) and WorkerError
        is raised with a note saying so; a dead or hung device, or a failed rollback, raises PoolBrokenError."""
        devices = range(self.num_devices)
        try:
            self.group.call(devices, "update_weights", named_tensors, what="update_weights",
                            timeout=self.deadline(0))
        except WorkerError as e:
            if e.unresponsive:
                raise
            try:
                self.group.call(devices, "rollback", self.base, None, what="rollback", timeout=self.deadline(0))
            except Exception as e2:
                raise PoolBrokenError(f"update_weights failed ({e}), and rolling back to the base layout "
                                      f"{self.base} failed ({e2}); the pool is broken") from e2
            self.layout = self.base
            e.add_note(f"every device rolled back to the base layout {self.base} with this bucket's previous "
                       "weights (earlier buckets of the update kept)")
            raise
        self.group.call(devices, "commit_weights", what="update_weights (commit)", timeout=self.deadline(0))

    def release(self, tags: list[str]) -> None:
        self.group.call(range(self.num_devices), "release", tags, what="release", timeout=self.deadline(0))

    def resume(self, tags: list[str]) -> None:
        self.group.call(range(self.num_devices), "resume", tags, what="resume", timeout=self.deadline(0))

    def info(self) -> list[dict[str, Any]]:
        return self.group.call(range(self.num_devices), "info", timeout=self.deadline(0))

    def shutdown(self) -> None:
        self.group.shutdown()
