"""Driver side of a rebalance: move chosen unfinished requests between replicas of the current layout.

    plan -> export (only the moved requests, from their replicas) -> KV hand-off (migrated ones)
         -> release (sources free the handed-off KV) -> import (destination replicas)

No weights move and no groups switch; requests that are not moved stay where they are. Each moved request is
migrated or recomputed per the one cost model (`reconfigure.handoff_method`), with the reconfiguration's shared
steps (`plan_handoff`, `import_states`, `unique_states`). A failure in any phase drops every moved request
wherever it got to and re-imports it on its source replica for recomputation, so no request is lost, then raises
RebalanceError (a ReconfigurationError) whose `assignment` is the one before the rebalance.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from pat_rollout.driver.errors import PoolBrokenError, RebalanceError, WorkerError
from pat_rollout.driver.pool import RebalanceResult
from pat_rollout.layout import Layout
from pat_rollout.types import RequestState
from pat_rollout.workers.reconfigure import (
    handoff_method,
    import_states,
    plan_handoff,
    unique_states,
)

if TYPE_CHECKING:
    from pat_rollout.workers.reconfigure import Reconfigurer

logger = logging.getLogger(__name__)


def check_moves(layout: Layout, moves: Mapping[str, int], assignment: Mapping[str, int]) -> None:
    """ValueError unless every move names an unfinished request and another replica of `layout`."""
    for rid, dst in moves.items():
        if rid not in assignment:
            raise ValueError(f"rebalance: request {rid!r} is not unfinished (unfinished: {sorted(assignment)[:8]}...)")
        if not 0 <= dst < layout.num_replicas or dst == assignment[rid]:
            raise ValueError(f"rebalance: request {rid!r} on replica {assignment[rid]} cannot move to replica {dst} "
                             f"of {layout} ({layout.num_replicas} replicas)")


def run_rebalance(rc: Reconfigurer, layout: Layout, moves: Mapping[str, int],
                  assignment: Mapping[str, int]) -> RebalanceResult:
    """Apply `moves` (request id -> destination replica) on `rc.group` in `layout`, with `rc`'s hand-off mode,
    cost model and model spec. `assignment` maps every unfinished request to its replica now."""
    t_start = time.perf_counter()
    check_moves(layout, moves, assignment)
    group = rc.group
    src_of = {rid: assignment[rid] for rid in moves}
    by_src: dict[int, list[str]] = {}
    for rid in sorted(moves):
        by_src.setdefault(src_of[rid], []).append(rid)
    involved = sorted({d for r in (*src_of.values(), *moves.values()) for d in layout.groups[r]})
    result = RebalanceResult(layout=layout, moves=dict(moves))
    result.phase_s["plan"] = time.perf_counter() - t_start
    states: list[RequestState] = []
    timeout = rc.deadline(0)
    phase = "rebalance export"
    try:
        t = time.perf_counter()
        calls = {d: ("export_requests", (ids,)) for r, ids in by_src.items() for d in layout.groups[r]}
        exported = dict(zip(calls, group.call_each(calls, what=phase, timeout=timeout)))
        states = unique_states(layout, [exported.get(d, []) for d in range(group.num_devices)])
        result.phase_s["export"] = time.perf_counter() - t

        migrated, recomputed, kv_plan = plan_handoff(
            states, lambda s: handoff_method(rc.handoff, rc.cost, rc.spec, rc.dtype_bytes, s.num_cached_tokens,
                                             layout.tp_size),
            {rid: layout.groups[r] for rid, r in src_of.items()}, {rid: layout.groups[r] for rid, r in moves.items()},
            rc.spec.num_kv_heads)
        phase, t = "rebalance KV hand-off", time.perf_counter()
        group.call(involved, "handoff_kv", kv_plan, what=phase,
                   timeout=rc.deadline(sum(s.num_cached_tokens for s in migrated)))
        result.phase_s["kv_handoff"] = time.perf_counter() - t

        phase, t = "rebalance release", time.perf_counter()
        group.call([d for r in by_src for d in layout.groups[r]], "release_exported", what=phase, timeout=timeout)
        result.phase_s["release"] = time.perf_counter() - t

        phase, t = "rebalance import", time.perf_counter()
        import_states(group, layout, states, moves, {s.request_id for s in migrated}, what=phase, timeout=timeout,
                      replicas=sorted(set(moves.values())))
        result.phase_s["import"] = time.perf_counter() - t
    except Exception as e:
        what = f"rebalance of {len(moves)} requests in {layout} failed in {phase}"
        if isinstance(e, WorkerError) and e.unresponsive:  # its calls queue behind the hung one
            raise PoolBrokenError(f"{what}: {e}; devices {list(e.devices)} are dead or hung, so the pool cannot "
                                  f"roll back and is broken") from e
        try:
            if phase == "rebalance KV hand-off":  # a failed transfer may leave gloo pairs closed on its peers
                group.call(range(group.num_devices), "rebuild_comm", group.new_init_method(),
                           what="rebuilding process groups", timeout=timeout)
            _rollback(rc, layout, sorted(moves), src_of, involved, states)
        except Exception as e2:
            raise PoolBrokenError(f"{what} ({e}), and its rollback failed ({e2}); the pool is broken") from e2
        raise _error(f"rebalance of {len(moves)} requests in {layout} failed ({e}); every moved request was "
                     f"re-imported on its source replica for recomputation", assignment) from e
    result.assignment = {**assignment, **moves}
    result.migrated = tuple(s.request_id for s in migrated)
    result.recomputed = tuple(s.request_id for s in recomputed)
    result.total_s = time.perf_counter() - t_start
    logger.info("rebalanced %d requests in %s in %.3f s: %s; %d migrated, %d recomputed", len(moves), layout,
                result.total_s, {k: round(v, 4) for k, v in result.phase_s.items()}, len(result.migrated),
                len(result.recomputed))
    return result


def _rollback(rc: Reconfigurer, layout: Layout, moved: list[str], src_of: Mapping[str, int], involved: list[int],
              exported: list[RequestState]) -> None:
    """Drop the moved requests on every involved device and re-import them on their source replicas for
    recomputation (a request's state is the same wherever it is: no step ran since the export)."""
    per_device = rc.group.call(involved, "drop_requests", moved, what="rebalance rollback", timeout=rc.deadline(0))
    found = {s.request_id: s for s in exported}
    for states in per_device:
        for s in states:
            found.setdefault(s.request_id, s)
    if missing := sorted(set(moved) - set(found)):
        raise RuntimeError(f"rebalance rollback: no device of {involved} holds requests {missing}")
    states = [found[rid] for rid in moved]
    import_states(rc.group, layout, states, src_of, set(), what="rebalance rollback import",
                  timeout=rc.deadline(0), replicas=sorted(set(src_of.values())))


def _error(message: str, assignment: Mapping[str, int]) -> RebalanceError:
    err = RebalanceError(message)
    err.assignment = dict(assignment)
    return err
