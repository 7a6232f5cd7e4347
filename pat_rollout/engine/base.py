"""The engine protocol shared by the reference engine and the SGLang backend."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pat_rollout.types import Request, RequestOutput, RequestState

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class RunningInfo:
    """Progress of one unfinished request, as the planner sees it."""

    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    max_new_tokens: int


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineSnapshot:
    """What the driver's planner needs from one replica: no tensors."""

    running: tuple[RunningInfo, ...]
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int


@dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    """Outcome of `step(num_steps)`: finished requests and counters for metrics."""

    finished: tuple[RequestOutput, ...]
    num_steps: int
    num_decode_tokens: int
    num_prefill_tokens: int
    num_running: int
    num_waiting: int
    elapsed_s: float
    extra: dict[str, Any] = field(default_factory=dict)


class Engine(ABC):
    """One TP shard of a generation engine. All methods are SPMD over the TP group."""

    @abstractmethod
    def add_requests(self, requests: Iterable[Request]) -> None:
        """Queue requests; they are prefilled by the next step that has KV capacity."""

    @abstractmethod
    def step(self, num_steps: int = 1) -> StepResult:
        """Run up to `num_steps` scheduler iterations (prefill new requests, decode running ones)."""

    @abstractmethod
    def has_unfinished(self) -> bool: ...

    @abstractmethod
    def snapshot(self) -> EngineSnapshot: ...

    @abstractmethod
    def export_requests(self, request_ids: Iterable[str] | None = None) -> list[RequestState]:
        """Remove unfinished requests (all when None) and return their state; their KV stays
        readable through `export_kv` until `free_exported()` is called."""

    @abstractmethod
    def export_kv(self, request_id: str, kv_heads: tuple[int, int]) -> torch.Tensor:
        """KV of an exported request for global KV heads [lo, hi) held by this rank:
        tensor [num_layers, 2, num_cached_tokens, hi - lo, head_dim]."""

    @abstractmethod
    def free_exported(self) -> None:
        """Release the KV blocks of exported requests."""

    @abstractmethod
    def import_requests(self, states: Iterable[RequestState],
                        kv: dict[str, torch.Tensor] | None = None) -> list[str] | None:
        """Continue requests. With `kv[request_id]` ([num_layers, 2, tokens, local_kv_heads, head_dim])
        their cache is written directly (migration); otherwise the cached prefix is recomputed. Returns
        the ids given KV that the engine recomputed anyway (None: the engine does not report it)."""

    @abstractmethod
    def abort_all(self) -> list[RequestOutput]:
        """Finish every request with finish_reason "abort", returning what was generated."""

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full (unsharded, HuggingFace-named) tensors; each rank keeps its shard."""

    @abstractmethod
    def release(self, tags: Iterable[str] = ("weights", "kv_cache")) -> None:
        """Free memory for the trainer (tags subset of {"weights", "kv_cache"})."""

    @abstractmethod
    def resume(self, tags: Iterable[str] = ("weights", "kv_cache")) -> None: ...
