"""The one balancing policy of pat_rollout, shared by the driver (dispatch, reconfiguration), the planner's
estimator and the simulator. Pure stdlib, deterministic."""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def balance(loads: Sequence[float], num_replicas: int) -> list[int]:
    """Replica index for each load: longest first onto the least-loaded replica (ties: fewer items, then lowest
    index). Deterministic; balances both the summed load and the count of items."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas={num_replicas} must be >= 1")
    order = sorted(range(len(loads)), key=lambda i: (-loads[i], i))
    heap = [(0.0, 0, r) for r in range(num_replicas)]
    out = [0] * len(loads)
    for i in order:
        load, count, r = heapq.heappop(heap)
        out[i] = r
        heapq.heappush(heap, (load + loads[i], count + 1, r))
    return out


def assign_new(replica_loads: Sequence[float], new_loads: Sequence[float]) -> list[int]:
    """Dispatch: each new item, in arrival order, onto the replica with the least load so far (ties: lowest
    index). `replica_loads` is what each replica already holds; with unit loads this is least-inflight."""
    if not replica_loads:
        raise ValueError("replica_loads is empty: a pool has at least one replica")
    load = list(replica_loads)
    out = []
    for x in new_loads:
        r = min(range(len(load)), key=lambda i: (load[i], i))
        load[r] += x
        out.append(r)
    return out
