"""What the driver schedules onto: the `Pool` protocol, the results its switches return and nothing else.

The driver (dispatch, polling, planner, stage metrics) talks only to a `Pool`; a backend package builds one from
`PatRolloutConfig` (`pat_rollout.backends`): Ray shard actors running the reference engine
(`pat_rollout.workers.pool.RefPool`) or ranks of SGLang scheduler processes (`pat_rollout.sglang.pool.SglPool`).
The errors a pool raises to the driver are in `driver.errors`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pat_rollout.engine.base import EngineSnapshot, StepResult
from pat_rollout.layout import Layout
from pat_rollout.types import Request, RequestOutput

if TYPE_CHECKING:
    from pat_rollout.planner import EngineSpec


@dataclass(slots=True)
class ReconfigResult:
    src: Layout
    dst: Layout
    phase_s: dict[str, float] = field(default_factory=dict)
    assignment: dict[str, int] = field(default_factory=dict)  # request id -> new replica
    migrated: tuple[str, ...] = ()  # resumed from handed-off KV, as the engines report it
    recomputed: tuple[str, ...] = ()  # including migrations the engines fell back from (import_fallbacks)
    import_fallbacks: tuple[str, ...] = ()
    kv_bytes_received: int = 0  # KV bytes that crossed devices in the hand-off, summed over devices
    total_s: float = 0.0


@dataclass(slots=True)
class RebalanceResult:
    layout: Layout
    moves: dict[str, int]  # request id -> destination replica
    phase_s: dict[str, float] = field(default_factory=dict)
    assignment: dict[str, int] = field(default_factory=dict)  # request id -> replica, every request
    migrated: tuple[str, ...] = ()
    recomputed: tuple[str, ...] = ()
    total_s: float = 0.0


class Pool(ABC):
    """`num_devices` devices in `layout`; replica r is `layout.groups[r]`. Called from one thread."""

    num_devices: int
    layout: Layout
    base: Layout
    supports_rebalance: bool = False  # the planner offers rebalancing only where this is True
    # KV tokens one replica of the current layout holds (`planner.capacity.tokens_in_room`), where the pool
    # reports it (SglPool); None where it does not. Read into the stage metrics at each layout.
    kv_tokens: int | None = None
    # The snapshots `step` returns are the engine's own scheduler state (running vs queued, KV blocks in use), so
    # the driver hands them to the planner (ClusterState.loads, ReqProgress.cached); False where they are the
    # pool's estimate (the SGLang pool counts every tracked request as running).
    reports_load: bool = False
    # update_weights loads into whatever layout the pool is in (and keeps the base-layout host backup right), so
    # the driver loads the next stage's starting layout; False: the driver returns to the base layout first.
    weights_in_any_layout: bool = False

    @abstractmethod
    def check_request(self, request: Request) -> None:
        """ValueError if `request` can never run on this pool (token ids outside the vocab, too long, more KV
        than a device holds); called for every request of a batch before any of it starts."""

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

    def entry_cost_s(self, tp: int) -> float:
        """Seconds a switch into TP `tp` would still spend once, beyond moving weights and KV (e.g. capturing that
        layout's decode graphs where start-up did not); the planner adds them to that switch's cost."""
        return 0.0

    def engine_spec(self) -> EngineSpec | None:
        """The engine's scheduler rules and the KV tokens one replica of each TP size holds, as the planner's
        lookahead reads them (ClusterState.reported_spec); None where the pool does not say."""
        return None

    @abstractmethod
    def update_weights(self, named_tensors: list[tuple[str, Any]]) -> None:
        """Full HF-named tensors (one bucket of an update), loaded into the current layout: the base layout unless
        `weights_in_any_layout` (the driver returns there first)."""

    @abstractmethod
    def release(self, tags: list[str]) -> None: ...

    @abstractmethod
    def resume(self, tags: list[str]) -> None: ...

    @abstractmethod
    def info(self) -> list[dict[str, Any]]:
        """One dict per device (pid, layout, groups)."""

    @abstractmethod
    def shutdown(self) -> None: ...
