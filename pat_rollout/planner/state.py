"""What the planner sees (ClusterState) and what it answers (Decision). Frozen records, pure stdlib."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pat_rollout.planner.rebalance import Move

if TYPE_CHECKING:
    from pat_rollout.planner.engine_spec import EngineSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class ReqProgress:
    """One unfinished request. `replica` is the index of the TP group holding it now (None if unknown: the
    estimator then assumes the driver's dispatch). `prompt_key` identifies the prompt across RL iterations.
    `cached`: whether its KV is on its replica now (running at the last poll), False when it waits for (re-)prefill
    (queued or preempted), None when the engine did not say (the lookahead then assumes every started request runs).
    The driver fills it from the poll's snapshot (driver.planner_glue.cluster_state)."""

    request_id: str
    prompt_key: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    max_new_tokens: int
    replica: int | None = None
    cached: bool | None = None

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0 or self.num_output_tokens < 0 or self.max_new_tokens < 1:
            raise ValueError(f"request {self.request_id!r}: num_prompt_tokens={self.num_prompt_tokens}, "
                             f"num_output_tokens={self.num_output_tokens} must be >= 0 and "
                             f"max_new_tokens={self.max_new_tokens} >= 1")
        if self.num_output_tokens >= self.max_new_tokens:
            raise ValueError(f"request {self.request_id!r} is finished: num_output_tokens={self.num_output_tokens}"
                             f" >= max_new_tokens={self.max_new_tokens}")

    @property
    def num_tokens(self) -> int:
        """Tokens with KV: prompt plus generated."""
        return self.num_prompt_tokens + self.num_output_tokens


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaLoad:
    """One replica's scheduler state at the last poll, as its engine reported it: requests queued for (re-)prefill,
    requests running, and KV tokens in use out of the replica's capacity (a request's KV counts once per replica,
    whatever its TP)."""

    num_waiting: int
    num_running: int
    kv_tokens_used: int
    kv_tokens_capacity: int

    def __post_init__(self) -> None:
        if min(self.num_waiting, self.num_running, self.kv_tokens_used) < 0 or self.kv_tokens_capacity < 1 \
                or self.kv_tokens_used > self.kv_tokens_capacity:
            raise ValueError(f"num_waiting={self.num_waiting}, num_running={self.num_running}, kv_tokens_used="
                             f"{self.kv_tokens_used} must be >= 0 and <= kv_tokens_capacity={self.kv_tokens_capacity}"
                             " (>= 1)")

    @property
    def kv_tokens_free(self) -> int:
        return self.kv_tokens_capacity - self.kv_tokens_used


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterState:
    """Snapshot of one generation stage: `step` decode steps since the stage started (the most any replica ran),
    `num_devices` devices in `num_devices // tp` TP groups of size `tp`, and the unfinished requests.
    What the pool's poll reported, where it did: `loads[r]` for every replica r (empty: not reported) and
    `reported_spec`, the engine's scheduler rules and KV capacity as the pool states them (None: the planner's
    own EngineSpec or its default; the lookahead prefers the reported one). `entry_s`: (tp, seconds) for every layout
    a switch into which would still pay a one-time cost beyond moving weights and KV (a decode-graph capture not
    done at start-up: `Pool.entry_cost_s`); the planner adds it to that switch's cost."""

    step: int
    num_devices: int
    tp: int
    requests: tuple[ReqProgress, ...]
    loads: tuple[ReplicaLoad, ...] = ()
    reported_spec: EngineSpec | None = None
    entry_s: tuple[tuple[int, float], ...] = ()

    def entry_cost_s(self, tp: int) -> float:
        return next((s for t, s in self.entry_s if t == tp), 0.0)

    def __post_init__(self) -> None:
        if self.tp < 1 or self.num_devices % self.tp:
            raise ValueError(f"tp={self.tp} must divide num_devices={self.num_devices}")
        if self.step < 0:
            raise ValueError(f"step={self.step} must be >= 0")
        if self.loads and len(self.loads) != self.num_devices // self.tp:
            raise ValueError(f"{len(self.loads)} replica loads for {self.num_devices // self.tp} replicas "
                             f"(num_devices={self.num_devices}, tp={self.tp})")

    @property
    def num_replicas(self) -> int:
        return self.num_devices // self.tp


@dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    """Act now. action "regroup": reconfigure from `source_tp` to `target_tp`; action "rebalance": apply `moves`
    between replicas of the current layout (source_tp == target_tp). Times are predictions in seconds: remaining
    generation time if we stay, remaining time after the action (excluding overhead), and its overhead."""

    step: int
    source_tp: int
    target_tp: int
    predicted_remaining_now_s: float
    predicted_remaining_target_s: float
    predicted_overhead_s: float
    reason: str
    action: str = "regroup"
    moves: tuple[Move, ...] = ()

    def __post_init__(self) -> None:
        if self.action not in ("regroup", "rebalance"):
            raise ValueError(f"action={self.action!r} must be 'regroup' or 'rebalance'")
        if (self.action == "rebalance") != bool(self.moves) or (self.action == "rebalance"
                                                                  and self.source_tp != self.target_tp):
            raise ValueError(f"action={self.action!r} with {len(self.moves)} moves and tp {self.source_tp}->"
                             f"{self.target_tp}: a rebalance has moves and keeps its TP, a regroup has no moves")

    @property
    def is_rebalance(self) -> bool:
        return self.action == "rebalance"

    @property
    def predicted_saving_s(self) -> float:
        return self.predicted_remaining_now_s - self.predicted_remaining_target_s - self.predicted_overhead_s
