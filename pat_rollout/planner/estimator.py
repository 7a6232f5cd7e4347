"""Predicted time to drain the remaining generation under a layout (tp, num_devices // tp replicas), every request
decoding from now on with no KV capacity, admission or prefill: a quick closed form, the planner's default
estimator (PlannerConfig.estimator="drain"; "lookahead" runs the engine's mechanics instead, lookahead.py).
Pure stdlib. Integrates decode-step latency piecewise: a replica's batch only changes when one of its requests
finishes, so each stretch between finishes is one chunk (split so the mean context stays near the midpoint)."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

from pat_rollout.planner.balance import balance
from pat_rollout.planner.calibration import CalibratedModel
from pat_rollout.profile.model import LatencyModel, _segment

MAX_CHUNK_STEPS = 1024


def replica_drain_s(model: LatencyModel, tp: int, remaining: Sequence[int], num_tokens: Sequence[int],
                    max_chunk_steps: int = MAX_CHUNK_STEPS) -> float:
    """Seconds for one TP=`tp` replica to run its requests to completion: request i needs remaining[i] more
    steps and has num_tokens[i] tokens now (its context grows by one per step). Step times come from
    `_step_table` (the same arithmetic as `model.decode_step_s`, its batch interpolation cached), so the answer
    is the one `slow_replica_drain_s` gives, bit for bit."""
    table = _step_table(model, tp)
    if table is None:
        return slow_replica_drain_s(model, tp, remaining, num_tokens, max_chunk_steps)
    rows, ctxs, factor = table
    last = len(ctxs) - 2
    c0 = ctxs[0]
    single = len(ctxs) == 1
    items = sorted(zip(remaining, num_tokens))
    batch = len(items)
    sum_ctx = sum(num_tokens)
    done = 0  # steps taken so far
    total = 0.0
    k = 0
    n_items = len(items)
    f_low, f_value = 1 << 62, 1.0  # the factor's batch bucket starts at f_low
    while k < n_items:
        r = items[k][0]
        steps = r - done
        if steps > 0:
            row = rows.get(batch)
            if row is None:
                row = rows[batch] = _row(model, tp, batch)
            f = None
            if factor is not None:  # one per (tp, batch_bucket(batch)): [2^b, 2^(b+1)); the batch only falls
                if batch < f_low:
                    f_low, f_value = 1 << (batch.bit_length() - 1), factor(tp, batch)
                f = f_value
            while steps > 0:
                n = min(steps, max_chunk_steps)
                x = sum_ctx / batch + done + n / 2.0
                if single or x <= c0:
                    step = row[0]
                else:
                    j = min(bisect_right(ctxs, x) - 1, last)
                    lo = row[j]
                    step = lo + (x - ctxs[j]) / (ctxs[j + 1] - ctxs[j]) * (row[j + 1] - lo)
                total += n * (step if f is None else step * f)
                done += n
                steps -= n
        while k < n_items and items[k][0] == r:
            sum_ctx -= items[k][1]
            batch -= 1
            k += 1
    return total


def slow_replica_drain_s(model: LatencyModel, tp: int, remaining: Sequence[int], num_tokens: Sequence[int],
                         max_chunk_steps: int = MAX_CHUNK_STEPS) -> float:
    """`replica_drain_s` through `model.decode_step_s` at every chunk (the reference the fast path is tested
    against, and the path for a model whose step times are not a profile grid)."""
    items = sorted(zip(remaining, num_tokens))
    batch = len(items)
    sum_ctx = sum(num_tokens)
    done = 0  # steps taken so far
    total = 0.0
    k = 0
    while k < len(items):
        r = items[k][0]
        steps = r - done
        while steps > 0:
            n = min(steps, max_chunk_steps)
            mid_ctx = sum_ctx / batch + done + n / 2.0
            total += n * model.decode_step_s(tp, batch, mid_ctx)
            done += n
            steps -= n
        while k < len(items) and items[k][0] == r:
            sum_ctx -= items[k][1]
            batch -= 1
            k += 1
    return total


# Per profile grid (kept alive beside its id): batch -> the grid's step times at that batch, one per context
# point, i.e. LatencyModel.decode_step_s's interpolation along the batch axis done once.
_ROWS: dict[int, tuple[object, dict[int, dict[int, tuple[float, ...]]]]] = {}


def _row(model: LatencyModel, tp: int, batch: int) -> tuple[float, ...]:
    g = model._grid(tp)
    i, tb = _segment(g.batches, batch)
    i1 = min(i + 1, len(g.batches) - 1)
    s = g.step_s
    return tuple(s[i][j] + tb * (s[i1][j] - s[i][j]) for j in range(len(g.contexts)))


def _step_table(model: LatencyModel, tp: int):
    """(rows by batch, the grid's contexts, the calibration's factor(tp, batch) or None) for a plain profile or a
    calibrated one; None for any other LatencyModel (its own decode_step_s is then called)."""
    if type(model) is CalibratedModel:
        factor = model.calibration.decode_factor
    elif type(model) is LatencyModel:
        factor = None
    else:
        return None
    grids = model._grids
    entry = _ROWS.get(id(grids))
    if entry is None or entry[0] is not grids:
        entry = _ROWS[id(grids)] = (grids, {})
    per_tp = entry[1].get(tp)
    if per_tp is None:
        per_tp = entry[1][tp] = {}
    return per_tp, model._grid(tp).contexts, factor


def drain_s(model: LatencyModel, *, tp: int, num_devices: int, remaining: Sequence[int], num_tokens: Sequence[int],
            replicas: Sequence[int] | None = None) -> float:
    """Seconds until the last of `num_devices // tp` replicas finishes. `replicas` gives each request's replica;
    None balances the requests by `remaining` (what a reconfiguration would do)."""
    num_replicas = num_devices // tp
    if replicas is None:
        replicas = balance(remaining, num_replicas)
    per: list[tuple[list[int], list[int]]] = [([], []) for _ in range(num_replicas)]
    for r, n, rep in zip(remaining, num_tokens, replicas):
        if not 0 <= rep < num_replicas:
            raise ValueError(f"replica={rep} is out of range [0, {num_replicas}) for tp={tp}, "
                             f"num_devices={num_devices}")
        per[rep][0].append(r)
        per[rep][1].append(n)
    return max((replica_drain_s(model, tp, rs, ns) for rs, ns in per if rs), default=0.0)


def start_drain_s(model: LatencyModel, *, tp: int, num_devices: int, remaining: Sequence[int],
                  num_tokens: Sequence[int], prompt_tokens: int) -> float:
    """A stage not started yet: `drain_s` of its requests (balanced, replicas unknown) plus the prefill of its
    `prompt_tokens` prompt tokens spread evenly over the replicas."""
    return (drain_s(model, tp=tp, num_devices=num_devices, remaining=remaining, num_tokens=num_tokens)
            + model.prefill_s(tp, -(-prompt_tokens // (num_devices // tp))))
