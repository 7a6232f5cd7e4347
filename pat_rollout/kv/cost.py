"""Pure cost model choosing, per request, between migrating its KV cache and recomputing it (prefill), and the
memory bound on what one hand-off may migrate (`fit_to_cap`), shared by every pool.

Constants are measured on the target hardware (see `profile/`) and passed in; nothing here guesses them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pat_rollout.profile.model import LatencyModel

logger = logging.getLogger(__name__)


class HandoffMethod(str, Enum):
    """How an unfinished request's KV reaches its new replica."""

    MIGRATE = "migrate"
    RECOMPUTE = "recompute"

    @property
    def is_migrate(self) -> bool:
        return self is HandoffMethod.MIGRATE

    @property
    def is_recompute(self) -> bool:
        return self is HandoffMethod.RECOMPUTE


@dataclass(frozen=True, slots=True)
class HandoffDecision:
    """The chosen method and both estimates (seconds), kept for logs. `forced` when the caller's mode fixed it."""

    method: HandoffMethod
    migrate_s: float
    recompute_s: float
    forced: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class HandoffCost:
    """Measured constants of the hand-off cost model.

    migrate_s   = num_transfers * per_transfer_latency_s + num_cached_tokens * kv_bytes_per_token / link_bytes_per_s
    recompute_s = prefill_latency_s + num_cached_tokens / prefill_tokens_per_s(tp_dst)

    `prefill_tokens_per_s` holds measured (tp_size, tokens/s) pairs; a TP size not measured is scaled
    linearly from the nearest measured one below it (or the smallest), an optimistic bound for recompute.
    `kv_bytes_per_token` is what must cross links per token for the request (all layers, all moved heads),
    and `link_bytes_per_s` the aggregate bandwidth those transfers share.
    """

    link_bytes_per_s: float
    per_transfer_latency_s: float
    prefill_tokens_per_s: tuple[tuple[int, float], ...]
    prefill_latency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.link_bytes_per_s <= 0 or self.per_transfer_latency_s < 0 or self.prefill_latency_s < 0:
            raise ValueError(f"link_bytes_per_s={self.link_bytes_per_s} must be > 0, per_transfer_latency_s="
                             f"{self.per_transfer_latency_s} and prefill_latency_s={self.prefill_latency_s} >= 0")
        if not self.prefill_tokens_per_s or any(tp <= 0 or rate <= 0 for tp, rate in self.prefill_tokens_per_s):
            raise ValueError(
                f"prefill_tokens_per_s={self.prefill_tokens_per_s} needs positive (tp_size, tokens/s) pairs")

    def prefill_rate(self, tp_size: int) -> float:
        """Prefill tokens/s at `tp_size`: measured, else linear scaling from the nearest measured size below."""
        table = dict(self.prefill_tokens_per_s)
        if tp_size in table:
            return table[tp_size]
        below = [tp for tp in table if tp < tp_size]
        base = max(below) if below else min(table)
        return table[base] * tp_size / base

    def migrate_seconds(self, num_cached_tokens: int, kv_bytes_per_token: int, num_transfers: int = 1) -> float:
        if num_cached_tokens == 0:
            return 0.0
        wire_s = num_cached_tokens * kv_bytes_per_token / self.link_bytes_per_s
        return num_transfers * self.per_transfer_latency_s + wire_s

    def recompute_seconds(self, num_cached_tokens: int, tp_dst: int) -> float:
        if num_cached_tokens == 0:
            return 0.0
        return self.prefill_latency_s + num_cached_tokens / self.prefill_rate(tp_dst)

    def choose_handoff(self, num_cached_tokens: int, kv_bytes_per_token: int, tp_dst: int,
                       mode: str = "auto", num_transfers: int = 1) -> HandoffDecision:
        """Pick "migrate" or "recompute" for one request; mode "auto" takes the cheaper (ties recompute,
        which needs no peer), "migrate"/"recompute" force it. Both estimates are always returned."""
        if mode not in ("auto", "migrate", "recompute"):
            raise ValueError(f"mode={mode!r} must be 'auto', 'migrate' or 'recompute'")
        if num_cached_tokens < 0 or kv_bytes_per_token < 0 or tp_dst <= 0:
            raise ValueError(f"num_cached_tokens={num_cached_tokens} and kv_bytes_per_token={kv_bytes_per_token} "
                             f"must be >= 0 and tp_dst={tp_dst} > 0")
        migrate_s = self.migrate_seconds(num_cached_tokens, kv_bytes_per_token, num_transfers)
        recompute_s = self.recompute_seconds(num_cached_tokens, tp_dst)
        if mode == "auto":
            chosen = HandoffMethod.MIGRATE if migrate_s < recompute_s else HandoffMethod.RECOMPUTE
        else:
            chosen = HandoffMethod(mode)
        decision = HandoffDecision(chosen, migrate_s, recompute_s, forced=mode != "auto")
        logger.debug("handoff tokens=%d tp_dst=%d -> %s (migrate %.3g s, recompute %.3g s, forced=%s)",
                     num_cached_tokens, tp_dst, chosen.value, migrate_s, recompute_s, decision.forced)
        return decision


def choose_handoff(num_cached_tokens: int, kv_bytes_per_token: int, tp_dst: int, mode: str = "auto", *,
                   cost: HandoffCost, num_transfers: int = 1) -> HandoffDecision:
    """Function form of `HandoffCost.choose_handoff`."""
    return cost.choose_handoff(num_cached_tokens, kv_bytes_per_token, tp_dst, mode, num_transfers)


def fit_to_cap(candidates: Sequence[tuple[str, Sequence[int], int]], cap_bytes: int) -> tuple[list[str], list[str]]:
    """Which of the requests chosen for migration fit a hand-off's memory bound. `candidates`: (request_id, devices
    that receive its KV, bytes each of them receives), in the order they are considered; `cap_bytes`: the most KV one
    device may receive in one hand-off (PatRolloutConfig.kv_handoff_cap). Greedy: a request is migrated if every
    device it goes to still has room, else recomputed. Returns (migrate, recompute) request ids, in input order."""
    if cap_bytes < 0:
        raise ValueError(f"cap_bytes={cap_bytes} must be >= 0")
    used: dict[int, int] = {}
    keep, drop = [], []
    for request_id, devices, nbytes in candidates:
        if all(used.get(d, 0) + nbytes <= cap_bytes for d in devices):
            for d in devices:
                used[d] = used.get(d, 0) + nbytes
            keep.append(request_id)
        else:
            drop.append(request_id)
    if drop:
        logger.info("KV hand-off: %d request(s) recomputed instead of migrated: over the cap of %d bytes per device",
                    len(drop), cap_bytes)
    return keep, drop


def handoff_cost(model: LatencyModel) -> HandoffCost:
    """KV migration vs recomputation constants from a latency profile (the one the planner uses): the driver's
    hand-off choice, the planner's overhead estimates and the simulator read them from here."""
    prefill = model.prefill_table()
    return HandoffCost(link_bytes_per_s=model.kv_bandwidth, per_transfer_latency_s=model.kv_latency_s,
                       prefill_tokens_per_s=tuple((tp, rate) for tp, (rate, _) in sorted(prefill.items())),
                       prefill_latency_s=min(fixed for _, fixed in prefill.values()))
