"""Driver side of PAT's reconfiguration protocol.

    pause -> plan -> export -> KV hand-off -> reshard -> switch groups -> import (resume)

Generation is paused simply by not issuing steps. Each phase is one concurrent RPC to every device,
with a deadline, timed and logged. A failure in any phase on any device rolls back to the base layout
(weights restored from each device's host backup, process groups rebuilt after a failed transfer) and
re-imports every unfinished request for recomputation, so no request is lost, then raises
ReconfigurationError; where that cannot be done (a device died or hung) it raises PoolBrokenError.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, NoReturn

from pat_rollout.driver.errors import PoolBrokenError, ReconfigurationError, WorkerError
from pat_rollout.driver.pool import ReconfigResult
from pat_rollout.kv.cost import HandoffCost, choose_handoff, fit_to_cap
from pat_rollout.kv.plan import KVPlan, plan_kv
from pat_rollout.layout import Layout
from pat_rollout.layout.transition import PlanCache, plan_layout
from pat_rollout.planner.balance import balance
from pat_rollout.types import ModelSpec, RequestState

if TYPE_CHECKING:
    from pat_rollout.workers.group import WorkerGroup

logger = logging.getLogger(__name__)


def handoff_method(mode: str, cost: HandoffCost | None, spec: ModelSpec, dtype_bytes: int, num_cached_tokens: int,
                   dst_tp: int) -> str:
    """"migrate" or "recompute" for one request: `mode` unless it is "auto", else the cost model's choice."""
    if mode != "auto":
        return mode
    if cost is None:
        raise ValueError("kv_handoff='auto' needs a HandoffCost (measured constants from a latency profile)")
    kv_bytes = spec.kv_bytes_per_token(1, dtype_bytes)  # every KV head crosses a link once
    return choose_handoff(num_cached_tokens, kv_bytes, dst_tp, "auto", cost=cost).method.value


def balance_states(states: list[RequestState], num_replicas: int) -> dict[str, int]:
    """Assign requests to replicas with the shared balancing rule (planner.balance), load = context tokens."""
    replicas = balance([s.num_tokens for s in states], num_replicas)
    return {s.request_id: r for s, r in zip(states, replicas)}


# Phases that move tensors between devices: a failure there may leave gloo pairs closed on a peer that
# timed out waiting, so their rollback rebuilds every process group.
TRANSFER_PHASES = ("KV hand-off", "reshard")


class Reconfigurer:
    """Runs layout transitions on a WorkerGroup. Holds the plan cache and the hand-off cost model.
    `deadline(tokens)` gives each phase's RPC deadline in seconds from the tokens it processes."""

    def __init__(self, group: WorkerGroup, spec: ModelSpec, shard_specs: dict, base: Layout, *,
                 handoff: str = "auto", cost: HandoffCost | None = None, dtype_bytes: int = 4,
                 deadline: Callable[[int], float] | None = None, kv_cap_bytes: int | None = None) -> None:
        self.group = group
        self.kv_cap_bytes = kv_cap_bytes  # most KV bytes one device receives per hand-off (None: no cap)
        self.spec = spec
        self.shard_specs = shard_specs
        self.base = base
        self.handoff = handoff
        self.cost = cost
        self.dtype_bytes = dtype_bytes
        self.deadline = deadline or (lambda tokens: group.default_timeout_s)
        self.plans = PlanCache()

    def run(self, src: Layout, dst_tp: int, old_assignment: dict[str, int]) -> ReconfigResult:
        """src -> TP `dst_tp`. Every phase sits in one rollback path: on any failure the pool returns to
        the base layout with every unfinished request re-imported (ReconfigurationError), or, if that is
        impossible (a device died or hung, or the rollback failed), PoolBrokenError."""
        devices = range(self.group.num_devices)
        t_start = time.perf_counter()
        self.spec.check_tp(dst_tp)
        dst = plan_layout(src, dst_tp, base=self.base)
        weight_plan = self.plans.get(src, dst, self.shard_specs)
        result = ReconfigResult(src=src, dst=dst)
        result.phase_s["plan"] = time.perf_counter() - t_start
        states: list[RequestState] | None = None
        phase = "export"
        try:
            t = time.perf_counter()
            per_device = self.group.call(devices, "export_requests", what=phase, timeout=self.deadline(0))
            states = unique_states(src, per_device)
            result.phase_s["export"] = time.perf_counter() - t
            assignment = balance_states(states, dst.num_replicas)
            migrated, _, kv_transfers = plan_handoff(
                states, lambda s: self._method(s, dst), {rid: src.groups[r] for rid, r in old_assignment.items()},
                {rid: dst.groups[r] for rid, r in assignment.items()}, self.spec.num_kv_heads,
                cap_bytes=self.kv_cap_bytes, bytes_per_token=lambda tp: self.spec.kv_bytes_per_token(tp,
                                                                                               self.dtype_bytes))

            phase, t = "KV hand-off", time.perf_counter()
            self.group.call(devices, "handoff_kv", kv_transfers, what=phase,
                            timeout=self.deadline(sum(s.num_cached_tokens for s in migrated)))
            result.phase_s["kv_handoff"] = time.perf_counter() - t

            phase, t = "reshard", time.perf_counter()
            self.group.call(devices, "reshard", weight_plan, what=phase, timeout=self.deadline(0))
            result.phase_s["reshard"] = time.perf_counter() - t

            phase, t = "group switch", time.perf_counter()
            self.group.call(devices, "switch", dst, what=phase, timeout=self.deadline(0))
            result.phase_s["switch"] = time.perf_counter() - t

            phase, t = "import", time.perf_counter()
            reports = import_states(self.group, dst, states, assignment, {s.request_id for s in migrated},
                                    what=phase, timeout=self.deadline(0))
            result.phase_s["import"] = time.perf_counter() - t
        except Exception as e:
            self._fail(e, phase, src, dst_tp, states)
        fallbacks = {rid for rep in reports for rid in rep["fallbacks"]}
        result.assignment = assignment
        result.migrated = tuple(s.request_id for s in migrated if s.request_id not in fallbacks)
        result.recomputed = tuple(s.request_id for s in states if s.request_id not in result.migrated)
        result.import_fallbacks = tuple(sorted(fallbacks))
        result.kv_bytes_received = sum(rep["kv_bytes_received"] for rep in reports)
        result.total_s = time.perf_counter() - t_start
        logger.info("reconfigured %s -> %s in %.3f s: %s; %d migrated, %d recomputed (%d fallbacks), %d KV bytes",
                    src, dst, result.total_s, {k: round(v, 4) for k, v in result.phase_s.items()},
                    len(result.migrated), len(result.recomputed), len(fallbacks), result.kv_bytes_received)
        return result

    def _fail(self, error: Exception, phase: str, src: Layout, dst_tp: int,
              states: list[RequestState] | None) -> NoReturn:
        what = f"reconfiguration {src} -> TP{dst_tp} failed in {phase}"
        if isinstance(error, WorkerError) and error.unresponsive:  # its calls queue behind the hung one
            raise PoolBrokenError(f"{what}: {error}; devices {list(error.devices)} are dead or hung, "
                                  f"so the pool cannot roll back and is broken") from error
        try:
            states, assignment = self._rollback(states, rebuild_comm=phase in TRANSFER_PHASES)
        except Exception as e2:
            raise PoolBrokenError(f"{what} ({error}), and rolling back to the base layout {self.base} failed "
                                  f"({e2}); the pool is broken") from e2
        raise ReconfigurationError(
            f"{what} ({error}); rolled back to base layout {self.base}, {len(states)} unfinished requests "
            f"re-imported for recomputation", assignment) from error

    def _method(self, state: RequestState, dst: Layout) -> str:
        return handoff_method(self.handoff, self.cost, self.spec, self.dtype_bytes, state.num_cached_tokens,
                              dst.tp_size)

    def _rollback(self, states: list[RequestState] | None, *,
                  rebuild_comm: bool) -> tuple[list[RequestState], dict[str, int]]:
        """Every device back to the base layout; `states` (None: the export did not complete, so take what
        the devices say they held) re-imported for recomputation. Returns the states and their replicas."""
        devices = range(self.group.num_devices)
        init_method = self.group.new_init_method() if rebuild_comm else None
        held = self.group.call(devices, "rollback", self.base, init_method, what="rollback",
                               timeout=self.deadline(0))
        if states is None:
            unique: dict[str, RequestState] = {}
            for per_device in held:
                for s in per_device:
                    unique.setdefault(s.request_id, s)
            states = list(unique.values())
        assignment = balance_states(states, self.base.num_replicas)
        import_states(self.group, self.base, states, assignment, set(), what="rollback import",
                      timeout=self.deadline(0))
        return states, assignment


# ---- steps shared with workers/rebalance.py ---------------------------------------------------------------
def limit_by_memory(states: list[RequestState], tokens: Callable[[RequestState], int],
                    dst_groups: Mapping[str, tuple[int, ...]], bytes_per_token: Callable[[int], int],
                    cap_bytes: int | None) -> tuple[list[RequestState], list[RequestState]]:
    """(migrate, recompute): the requests of `states` (chosen for migration) whose KV fits `cap_bytes` per receiving
    device (`kv.cost.fit_to_cap`; None: no cap). A device of a TPk replica receives `bytes_per_token(k)` per token."""
    if cap_bytes is None:
        return list(states), []
    keep, _ = fit_to_cap([(s.request_id, dst_groups[s.request_id],
                           tokens(s) * bytes_per_token(len(dst_groups[s.request_id]))) for s in states], cap_bytes)
    kept = set(keep)
    return [s for s in states if s.request_id in kept], [s for s in states if s.request_id not in kept]


def plan_handoff(states: list[RequestState], method: Callable[[RequestState], str],
                 src_groups: Mapping[str, tuple[int, ...]], dst_groups: Mapping[str, tuple[int, ...]],
                 num_kv_heads: int, *, cap_bytes: int | None = None,
                 bytes_per_token: Callable[[int], int] | None = None) -> tuple[list[RequestState], list[RequestState],
                                                                                KVPlan]:
    """Split `states` by `method(state)` ("migrate" or "recompute") and plan the KV hand-off of the migrated
    ones from their replica's devices (`src_groups[request_id]`) to their new replica's (`dst_groups`). With
    `cap_bytes`, migrated requests whose KV would not fit it on a receiving device are recomputed instead
    (`limit_by_memory`; `bytes_per_token(tp)`: KV bytes per token a device of a TP `tp` replica receives)."""
    migrated, recomputed = [], []
    for s in states:
        (migrated if method(s) == "migrate" else recomputed).append(s)
    if cap_bytes is not None:
        assert bytes_per_token is not None
        migrated, over = limit_by_memory(migrated, lambda s: s.num_cached_tokens, dst_groups, bytes_per_token,
                                         cap_bytes)
        recomputed += over
    moves = [(s.request_id, src_groups[s.request_id], dst_groups[s.request_id], s.num_cached_tokens)
             for s in migrated]
    return migrated, recomputed, plan_kv(moves, num_kv_heads)


def import_states(group: WorkerGroup, layout: Layout, states: list[RequestState], assignment: Mapping[str, int],
                  migrated: set[str], *, what: str, timeout: float | None = None,
                  replicas: Iterable[int] | None = None) -> list[dict]:
    """Every device of replica r (of `replicas`, default all) imports the requests assigned to r; those in
    `migrated` take their KV from the hand-off, the rest are recomputed. Returns the import reports, with request
    outcomes (`fallbacks`) kept once per replica (its TP ranks decide alike) and bytes counted on every device."""
    calls = {}
    for r in range(layout.num_replicas) if replicas is None else replicas:
        mine = [s for s in states if assignment[s.request_id] == r]
        ids = [s.request_id for s in mine if s.request_id in migrated]
        for d in layout.groups[r]:
            calls[d] = ("import_requests", (mine, ids))
    reports = dict(zip(calls, group.call_each(calls, what=what, timeout=timeout)))
    leads = {layout.groups[r][0] for r in range(layout.num_replicas)}
    return [dict(rep, fallbacks=rep["fallbacks"] if d in leads else ()) for d, rep in reports.items()]


def unique_states(layout: Layout, per_device: list[list[RequestState]]) -> list[RequestState]:
    """Every TP rank of a replica exports the same requests; keep TP rank 0's and check the rest."""
    states: list[RequestState] = []
    for group in layout.groups:
        lead = per_device[group[0]]
        for d in group[1:]:
            if [s.request_id for s in per_device[d]] != [s.request_id for s in lead]:
                raise RuntimeError(f"TP ranks of replica {group} disagree on unfinished requests: "
                                   f"device {group[0]} has {[s.request_id for s in lead]}, "
                                   f"device {d} has {[s.request_id for s in per_device[d]]}")
        states.extend(lead)
    return states
