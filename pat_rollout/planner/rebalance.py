"""Rebalancing: move unfinished requests between the replicas of the current layout (no TP change, no weight
movement). Which requests to move (`plan_moves`), what moving them costs (`rebalance_cost`, the same per-request
migrate-or-recompute rule as planner/cost.py) and the predicted remaining time afterwards (`rebalance_option`,
scored by planner/estimator.py's drain_s). Pure stdlib; the planner, the driver and the simulator share it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pat_rollout.kv.cost import handoff_cost
from pat_rollout.planner.balance import balance
from pat_rollout.planner.cost import prefers_migration
from pat_rollout.planner.estimator import drain_s
from pat_rollout.profile.model import LatencyModel


@dataclass(frozen=True, kw_only=True, slots=True)
class Move:
    """Request `request_id` moves from replica `src` to replica `dst` of the same layout."""

    request_id: str
    src: int
    dst: int

    def __post_init__(self) -> None:
        if self.src == self.dst or self.src < 0 or self.dst < 0:
            raise ValueError(f"move of {self.request_id!r}: src={self.src} and dst={self.dst} must be distinct "
                             "replica indices >= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class RebalanceCost:
    """Predicted pause of one rebalance: the KV of migrated requests crossing links plus the prefill of
    recomputed ones, each taken on the slowest destination replica (replicas receive in parallel)."""

    kv_s: float
    num_migrated: int
    num_recomputed: int

    @property
    def total_s(self) -> float:
        return self.kv_s


@dataclass(frozen=True, kw_only=True, slots=True)
class RebalanceOption:
    """A candidate rebalance as evaluated: its moves, predicted remaining seconds after it, and its cost."""

    moves: tuple[Move, ...]
    remaining_s: float
    cost: RebalanceCost

    @property
    def total_s(self) -> float:
        return self.remaining_s + self.cost.total_s


def plan_moves(request_ids: Sequence[str], replicas: Sequence[int], loads: Sequence[float], num_replicas: int,
               slack: float = 0.05) -> tuple[Move, ...]:
    """Few moves that bring the replicas near the assignment `planner.balance` gives the `loads` (predicted
    remaining work of each request; request i is on replica `replicas[i]`).

    Balanced bins are matched to the current replicas by the load they already share (greedy, largest shared
    load first), so a request whose bin maps to its own replica stays. Then moves are undone, smallest load
    first, while returning a request to its source keeps every replica within `slack` (a fraction) of the
    balanced maximum: balance's exact tie-breaking would otherwise swap short requests for no real gain.
    Deterministic. Returns moves ordered by request id."""
    n = len(request_ids)
    if not len(replicas) == len(loads) == n:
        raise ValueError(f"request_ids ({n}), replicas ({len(replicas)}) and loads ({len(loads)}) differ in length")
    if any(not 0 <= r < num_replicas for r in replicas):
        raise ValueError(f"replicas={list(replicas)} must lie in [0, {num_replicas})")
    if slack < 0:
        raise ValueError(f"slack={slack} must be >= 0")
    target = balance(loads, num_replicas)
    shared: dict[tuple[int, int], float] = {}
    for b, r, x in zip(target, replicas, loads):
        shared[(b, r)] = shared.get((b, r), 0.0) + x
    bin_to_rep: dict[int, int] = {}
    used: set[int] = set()
    for (b, r), _ in sorted(shared.items(), key=lambda kv: (-kv[1], kv[0])):
        if b not in bin_to_rep and r not in used:
            bin_to_rep[b] = r
            used.add(r)
    free = iter(r for r in range(num_replicas) if r not in used)
    for b in range(num_replicas):
        if b not in bin_to_rep:
            bin_to_rep[b] = next(free)
    dst = [bin_to_rep[b] for b in target]
    load = [0.0] * num_replicas
    for r, x in zip(dst, loads):
        load[r] += x
    cap = max(load, default=0.0) * (1.0 + slack)
    for i in sorted((i for i in range(n) if dst[i] != replicas[i]), key=lambda i: (loads[i], request_ids[i])):
        src = replicas[i]
        if load[src] + loads[i] <= cap:
            load[src] += loads[i]
            load[dst[i]] -= loads[i]
            dst[i] = src
    return tuple(sorted((Move(request_id=request_ids[i], src=replicas[i], dst=dst[i]) for i in range(n)
                         if dst[i] != replicas[i]), key=lambda m: m.request_id))


def rebalance_cost(model: LatencyModel, *, tp: int, moves: Sequence[Move],
                   num_tokens: Mapping[str, int]) -> RebalanceCost:
    """Predicted pause of applying `moves` at TP=`tp`; `num_tokens[request_id]` is each moved request's context
    (prompt + generated). Each request is migrated or recomputed by `planner.cost.prefers_migration`; a
    destination replica's tp devices receive its migrated KV in parallel, and recomputation is its prefill."""
    kv_bytes: dict[int, float] = {}
    prefill_tokens: dict[int, int] = {}
    num_migrated = 0
    handoff = handoff_cost(model)
    for m in moves:
        n = num_tokens[m.request_id]
        if prefers_migration(model, tp, n, handoff):
            kv_bytes[m.dst] = kv_bytes.get(m.dst, 0.0) + n * model.model.kv_bytes_per_token()
            num_migrated += 1
        else:
            prefill_tokens[m.dst] = prefill_tokens.get(m.dst, 0) + n
    kv_s = max((model.kv_migrate_s(b / tp) for b in kv_bytes.values()), default=0.0)
    kv_s += max((model.prefill_s(tp, t) for t in prefill_tokens.values()), default=0.0)
    return RebalanceCost(kv_s=kv_s, num_migrated=num_migrated, num_recomputed=len(moves) - num_migrated)


def rebalance_option(model: LatencyModel, *, tp: int, num_devices: int, request_ids: Sequence[str],
                     replicas: Sequence[int], remaining: Sequence[int],
                     num_tokens: Sequence[int]) -> RebalanceOption | None:
    """The rebalance `plan_moves` proposes for predicted `remaining` steps, scored with `drain_s` on the
    resulting per-replica assignment, or None when the requests are already balanced (nothing to move)."""
    num_replicas = num_devices // tp
    moves = plan_moves(request_ids, replicas, remaining, num_replicas)
    if not moves:
        return None
    dst = {m.request_id: m.dst for m in moves}
    after = [dst.get(rid, r) for rid, r in zip(request_ids, replicas)]
    remaining_s = drain_s(model, tp=tp, num_devices=num_devices, remaining=remaining, num_tokens=num_tokens,
                          replicas=after)
    cost = rebalance_cost(model, tp=tp, moves=moves, num_tokens=dict(zip(request_ids, num_tokens)))
    return RebalanceOption(moves=moves, remaining_s=remaining_s, cost=cost)
