"""Pure KV hand-off plans: which KV heads of which request each new-replica device needs, and from whom.

Stdlib + pat_rollout only. Head ranges are half-open [lo, hi) of global KV head indices. With more
ranks than KV heads a head is replicated on several ranks (SGLang's rule); any of its holders may send it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pat_rollout.layout.shard import kv_heads_for_rank


@dataclass(frozen=True, slots=True)
class KVMove:
    """Request `request_id` with `num_tokens` cached tokens moves from replica `src_group` to `dst_group`
    (device ids in TP-rank order)."""

    request_id: str
    src_group: tuple[int, ...]
    dst_group: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class KVTransfer:
    """KV of heads [kv_heads[0], kv_heads[1]) for tokens [0, num_tokens) of `request_id`, from `src_device`
    to `dst_device`. src_device == dst_device is a local copy. `task_id` is the position in the plan."""

    task_id: int
    request_id: str
    src_device: int
    dst_device: int
    kv_heads: tuple[int, int]
    num_tokens: int

    @property
    def num_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def is_local(self) -> bool:
        return self.src_device == self.dst_device


@dataclass(frozen=True, slots=True)
class KVPlan:
    """Transfers ordered by (move, dst rank, head); `moves` keeps the inputs for reference."""

    num_kv_heads: int
    moves: tuple[KVMove, ...]
    transfers: tuple[KVTransfer, ...]

    def transfers_for(self, device: int) -> tuple[KVTransfer, ...]:
        """Transfers `device` sends, receives or copies locally, in task_id order."""
        return tuple(t for t in self.transfers if device in (t.src_device, t.dst_device))

    def num_remote_head_tokens(self) -> int:
        """Sum of heads x tokens that cross devices (multiply by layers x 2 x head_dim x bytes for bytes)."""
        return sum(t.num_heads * t.num_tokens for t in self.transfers if not t.is_local)


MoveLike = KVMove | tuple[str, tuple[int, ...], tuple[int, ...], int]


def plan_kv(moves: Sequence[MoveLike], num_kv_heads: int) -> KVPlan:
    """Plan the KV hand-off of `moves` (KVMove or plain (request_id, src_group, dst_group, num_tokens)).

    Each dst device at new rank R needs heads `kv_heads_for_rank(num_kv_heads, R, len(dst_group))`. A head
    the device already held in the request's old replica is copied locally; otherwise it comes from an old
    holder with the fewest head-tokens assigned so far over the whole plan (ties: lowest old rank), so
    replicated heads spread their sends. Consecutive heads from the same source merge into one transfer.
    Raises ValueError when a group size and `num_kv_heads` neither divides the other, or a move is malformed.
    """
    norm = tuple(m if isinstance(m, KVMove) else KVMove(m[0], tuple(m[1]), tuple(m[2]), m[3]) for m in moves)
    load: dict[int, int] = {}
    out: list[KVTransfer] = []
    for move in norm:
        src_tp, dst_tp = len(move.src_group), len(move.dst_group)
        for tp in (src_tp, dst_tp):
            if tp == 0 or (num_kv_heads % tp and tp % num_kv_heads):
                raise ValueError(f"request {move.request_id}: group size {tp} and num_kv_heads={num_kv_heads}: "
                                 "one must divide the other")
        if move.num_tokens < 0:
            raise ValueError(f"request {move.request_id}: num_tokens={move.num_tokens} must be >= 0")
        held = [kv_heads_for_rank(num_kv_heads, r, src_tp) for r in range(src_tp)]
        for new_rank, device in enumerate(move.dst_group):
            lo, hi = kv_heads_for_rank(num_kv_heads, new_rank, dst_tp)
            run: tuple[int, int, int] | None = None  # (src_device, head_lo, head_hi)
            for head in range(lo, hi):
                holders = [(r, d) for r, d in enumerate(move.src_group) if held[r][0] <= head < held[r][1]]
                if any(d == device for _, d in holders):
                    src = device
                else:
                    src = min(holders, key=lambda h: (load.get(h[1], 0), h[0]))[1]
                    load[src] = load.get(src, 0) + move.num_tokens
                if run is not None and run[0] == src and run[2] == head:
                    run = (src, run[1], head + 1)
                    continue
                if run is not None:
                    out.append(KVTransfer(len(out), move.request_id, run[0], device, (run[1], run[2]), move.num_tokens))
                run = (src, head, head + 1)
            assert run is not None
            out.append(KVTransfer(len(out), move.request_id, run[0], device, (run[1], run[2]), move.num_tokens))
    return KVPlan(num_kv_heads, norm, tuple(out))
