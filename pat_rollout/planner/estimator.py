"""Predicted time to drain the remaining generation under a layout (tp, num_devices // tp replicas), every request
decoding from now on with no KV capacity, admission or prefill: a quick closed form, the planner's default
estimator (PlannerConfig.estimator="drain"; "lookahead" runs the engine's mechanics instead, lookahead.py).
Pure stdlib. Integrates decode-step latency piecewise: a replica's batch only changes when one of its requests
finishes, so each stretch between finishes is one chunk (split so the mean context stays near the midpoint)."""

from __future__ import annotations

from collections.abc import Sequence

from pat_rollout.planner.balance import balance
from pat_rollout.profile.model import LatencyModel

MAX_CHUNK_STEPS = 1024


def replica_drain_s(model: LatencyModel, tp: int, remaining: Sequence[int], num_tokens: Sequence[int],
                    max_chunk_steps: int = MAX_CHUNK_STEPS) -> float:
    """Seconds for one TP=`tp` replica to run its requests to completion: request i needs remaining[i] more
    steps and has num_tokens[i] tokens now (its context grows by one per step)."""
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
