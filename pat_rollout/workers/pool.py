"""What the driver schedules onto: the devices of one backend grouped into the current layout.

The driver (dispatch, polling, planner, stage metrics) is backend-neutral; a `Pool` hides whether a
replica is a set of Ray shard actors running the reference engine (`RefPool`, here) or ranks of SGLang
scheduler processes (`pat_rollout.sglang.pool.SglPool`). Both reuse layout/, reshard/, kv/ and comm/.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from pat_rollout.engine.base import EngineSnapshot, StepResult
from pat_rollout.layout import Layout
from pat_rollout.types import Request, RequestOutput
from pat_rollout.workers.errors import PoolBrokenError, WorkerError
from pat_rollout.workers.reconfigure import ReconfigResult

__all__ = ["Pool", "PoolBrokenError", "RefPool", "WorkerError"]

if TYPE_CHECKING:
    from pat_rollout.workers.rebalance import RebalanceResult


class Pool(ABC):
    """`num_devices` devices in `layout`; replica r is `layout.groups[r]`. Called from one thread."""

    num_devices: int
    layout: Layout
    base: Layout
    supports_rebalance: bool = False  # the planner offers rebalancing only where this is True

    @abstractmethod
    def add_requests(self, per_replica: dict[int, list[Request]]) -> None:
        """Start requests on their replicas."""

    @abstractmethod
    def step(self, replicas: Iterable[int], num_steps: int) -> dict[int, tuple[StepResult, EngineSnapshot]]:
        """Advance the busy replicas by `num_steps` decode steps; per replica its result and a snapshot."""

    @abstractmethod
    def reconfigure(self, dst_tp: int, assignment: dict[str, int]) -> ReconfigResult:
        """Move to TP `dst_tp`, keeping every unfinished request (`assignment`: request id -> replica).
        On failure roll back to `base`, re-admit every request and raise ReconfigurationError whose
        `assignment` says where each request now runs."""

    def rebalance(self, moves: dict[str, int], assignment: dict[str, int]) -> RebalanceResult:
        """Move unfinished requests to other replicas of the current layout (`moves`: request id -> replica),
        keeping every request. On failure re-admit each moved request on its source replica and raise
        RebalanceError. Pools that cannot (supports_rebalance False) refuse."""
        raise NotImplementedError(f"{type(self).__name__} cannot move requests between replicas "
                                  "(supports_rebalance=False)")

    @abstractmethod
    def abort_all(self) -> list[RequestOutput]:
        """Abort every request; one output per request (partial tokens, finish_reason 'abort')."""

    @abstractmethod
    def update_weights(self, named_tensors: list[tuple[str, Any]]) -> None:
        """Full HF-named tensors; the pool is in its base layout (the driver returns there first)."""

    @abstractmethod
    def release(self, tags: list[str]) -> None: ...

    @abstractmethod
    def resume(self, tags: list[str]) -> None: ...

    @abstractmethod
    def info(self) -> list[dict[str, Any]]:
        """One dict per device (pid, layout, groups)."""

    @abstractmethod
    def shutdown(self) -> None: ...


class RefPool(Pool):
    """The reference engine: one Ray `ShardWorker` actor per device, reconfigured by the `Reconfigurer`.
    Every call has a deadline `deadline(tokens)` from the tokens it may process (prefill + decode)."""

    supports_rebalance = True

    def __init__(self, group: Any, reconfigurer: Any, base: Layout, *,
                 deadline: Callable[[int], float] | None = None, max_num_seqs: int = 256,
                 kv_capacity_tokens: int = 0) -> None:
        self.group = group  # workers.group.WorkerGroup
        self.reconfigurer = reconfigurer
        self.num_devices = group.num_devices
        self.base = self.layout = base
        self.deadline = deadline or (lambda tokens: group.default_timeout_s)
        self.max_num_seqs = max_num_seqs
        self.kv_capacity_tokens = kv_capacity_tokens  # per device: bounds what a re-import recomputes
        self._prefill_tokens = 0  # tokens the next step may have to prefill (new and re-imported requests)
        self._comm_suspect = False  # a failed step may have left a peer's collective timed out

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
        from pat_rollout.workers.reconfigure import ReconfigurationError

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
        from pat_rollout.workers.rebalance import run_rebalance

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

    def update_weights(self, named_tensors: list[tuple[str, Any]]) -> None:
        self.group.call(range(self.num_devices), "update_weights", named_tensors, what="update_weights",
                        timeout=self.deadline(0))

    def release(self, tags: list[str]) -> None:
        self.group.call(range(self.num_devices), "release", tags, what="release", timeout=self.deadline(0))

    def resume(self, tags: list[str]) -> None:
        self.group.call(range(self.num_devices), "resume", tags, what="resume", timeout=self.deadline(0))

    def info(self) -> list[dict[str, Any]]:
        return self.group.call(range(self.num_devices), "info", timeout=self.deadline(0))

    def shutdown(self) -> None:
        self.group.shutdown()
