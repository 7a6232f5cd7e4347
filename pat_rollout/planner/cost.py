"""Overhead of switching the whole pool from TP=tp_src to TP=tp_dst. Pure stdlib.

Charged serially (conservative, no overlap): weight reshard + KV handoff + group switch/resume.
- Weights: a device needs param_bytes / tp_dst and holds param_bytes / tp_src, so growing TP moves nothing and
  shrinking gathers the difference; all devices receive in parallel.
- KV: every running request is handed off (the new layout rebalances requests, and even in place a TP change
  re-splits KV heads). Each request is migrated (kv bytes / bandwidth) or recomputed (prefill of its tokens),
  whichever is cheaper alone; migrations run on all devices in parallel, recomputation on all new replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pat_rollout.kv.cost import HandoffCost, handoff_cost
from pat_rollout.profile.model import LatencyModel


@dataclass(frozen=True, kw_only=True, slots=True)
class TransitionCost:
    """Seconds per component of one reconfiguration, and how many requests were migrated or recomputed."""

    reshard_s: float
    kv_s: float
    switch_s: float
    num_migrated: int
    num_recomputed: int

    @property
    def total_s(self) -> float:
        return self.reshard_s + self.kv_s + self.switch_s


def prefers_migration(model: LatencyModel, tp_dst: int, num_tokens: int, cost: HandoffCost | None = None) -> bool:
    """The per-request hand-off rule of every overhead estimate (regroup and rebalance): the driver's own
    (`kv.cost.HandoffCost.choose_handoff` in "auto" mode, constants from this profile; pass `cost` =
    `handoff_cost(model)` when calling it in a loop)."""
    cost = cost or handoff_cost(model)
    return cost.choose_handoff(num_tokens, model.model.kv_bytes_per_token(), tp_dst).method.is_migrate


def transition_cost(model: LatencyModel, *, num_devices: int, tp_src: int, tp_dst: int,
                    num_tokens: Sequence[int], migrates: Callable[[int, int], bool] | None = None) -> TransitionCost:
    """Cost of switching num_devices devices from tp_src to tp_dst with running requests of `num_tokens` tokens
    (prompt + generated) each. Zero when tp_src == tp_dst. `migrates(num_tokens, tp_dst)`: the hand-off rule
    (default `prefers_migration`; a caller scoring many layouts passes a memoised copy of it)."""
    if tp_src == tp_dst:
        return TransitionCost(reshard_s=0.0, kv_s=0.0, switch_s=0.0, num_migrated=0, num_recomputed=0)
    w = model.model.param_bytes
    reshard_s = model.reshard_s(max(0.0, w / tp_dst - w / tp_src))
    kv_per_token = model.model.kv_bytes_per_token()
    mig_bytes = 0
    recompute_tokens = 0
    num_migrated = 0
    if migrates is None:
        handoff = handoff_cost(model)

        def migrates(n: int, tp: int) -> bool:
            return prefers_migration(model, tp, n, handoff)
    seen: dict[int, bool] = {}  # the rule per distinct request size (requests of a batch share sizes)
    for n in num_tokens:
        mig = seen.get(n)
        if mig is None:
            mig = seen[n] = migrates(n, tp_dst)
        if mig:
            mig_bytes += n * kv_per_token
            num_migrated += 1
        else:
            recompute_tokens += n
    num_replicas_dst = num_devices // tp_dst
    kv_s = model.kv_migrate_s(mig_bytes / num_devices) + model.prefill_s(
        tp_dst, -(-recompute_tokens // num_replicas_dst))
    return TransitionCost(reshard_s=reshard_s, kv_s=kv_s, switch_s=model.group_switch_s, num_migrated=num_migrated,
                          num_recomputed=len(num_tokens) - num_migrated)
