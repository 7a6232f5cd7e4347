"""The KV-cache capacity rule: how many tokens a TP replica holds. One rule for the planner's lookahead
(`planner.lookahead`), the simulator (`sim.hardware`: a replica's KV room from a profile's memory; `sim.replica`:
blocks per request) and the SGLang pool (`sglang.kv_room`: its fixed KV storage re-viewed at every switch).

Per device: KV room = mem_fraction x HBM - weights / tp - activation reserve (`kv_room_bytes`; the SGLang pool
instead measures the storage SGLang allocated).

The room per layout differs by backend (`layout_kv_tokens`, one rule per backend, read by the simulator and the
planner):
- "stock": a stock engine launched at each TP: weights / tp per device, the rest KV (`stock_kv_tokens`).
- "sglang-pool": pat_rollout's SGLang pool keeps every device's base-layout weight storage in every layout (stable
  addresses) and re-views the KV storage allocated at the base layout, so a TPk replica holds k x the base TP1
  replica's tokens (`pool_kv_tokens`; sglang/kv_room.py applies the same `tokens_in_room` to its storage).
- "sglang-pool-reclaim": the SGLang pool with `reclaim_weight_memory` (docs/kv_reclaim.md): a layout lends the weight
  bytes its shard no longer uses to the KV storage, so its room is the base room + the weight bytes freed - what
  granule rounding keeps back (`reclaim_room_bytes`; `vmem.ReclaimPlan.loss_bytes` is that loss for real storages).
  Without a loss it is the stock room exactly (`reclaim_kv_tokens`).
- "ref-pool": the reference engine's fixed block pool per rank, every rank holding its share of the heads: the
  same tokens per replica at every TP (`block_pool_kv_tokens`). A TP group of `tp` devices shards the KV heads, so one token
costs kv_bytes_per_token * ceil(num_kv_heads / tp) / num_kv_heads bytes on each device (heads are replicated
once tp > num_kv_heads) and the replica holds room / that many tokens (`tokens_in_room`). Pure stdlib.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class MemorySpec:
    """Memory of one device as the serving engine sees it.

    - hbm_bytes: device memory (e.g. 80e9 for an H100 SXM 80 GB).
    - mem_fraction: share the engine may use for weights + KV (SGLang mem_fraction_static, verl
      gpu_memory_utilization: 0.6 when rollout is colocated with training).
    - activation_reserve_bytes: what activations, CUDA graphs and workspace keep out of the KV pool."""

    hbm_bytes: float
    mem_fraction: float
    activation_reserve_bytes: float

    def __post_init__(self) -> None:
        if self.hbm_bytes <= 0 or not 0 < self.mem_fraction <= 1 or self.activation_reserve_bytes < 0:
            raise ValueError(f"hbm_bytes={self.hbm_bytes} must be > 0, mem_fraction={self.mem_fraction} in (0, 1] "
                             f"and activation_reserve_bytes={self.activation_reserve_bytes} >= 0")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MemorySpec:
        """From a profile's optional "memory" section (keys as the field names)."""
        missing = [k for k in ("hbm_bytes", "mem_fraction", "activation_reserve_bytes") if k not in d]
        if missing:
            raise ValueError(f"memory section {d} is missing {missing}")
        return cls(hbm_bytes=float(d["hbm_bytes"]), mem_fraction=float(d["mem_fraction"]),
                   activation_reserve_bytes=float(d["activation_reserve_bytes"]))


def kv_room_bytes(mem: MemorySpec, *, param_bytes: float, tp: int) -> float:
    """Bytes of KV cache one device of a TP=`tp` group can hold (may be <= 0: the weights do not fit)."""
    if tp < 1:
        raise ValueError(f"tp={tp} must be >= 1")
    return mem.mem_fraction * mem.hbm_bytes - param_bytes / tp - mem.activation_reserve_bytes


def replica_kv_tokens(mem: MemorySpec, *, param_bytes: float, kv_bytes_per_token: int, num_kv_heads: int,
                      tp: int) -> int:
    """Tokens (summed over the requests it runs) of KV one TP=`tp` replica holds. ValueError when the weights
    leave no room, naming every operand."""
    room = kv_room_bytes(mem, param_bytes=param_bytes, tp=tp)
    if room <= 0:
        raise ValueError(f"no KV room at tp={tp}: mem_fraction {mem.mem_fraction} x hbm {mem.hbm_bytes:.4g} B - "
                         f"weights {param_bytes:.4g} B / {tp} - reserve {mem.activation_reserve_bytes:.4g} B = "
                         f"{room:.4g} B")
    return tokens_in_room(room, kv_bytes_per_token=kv_bytes_per_token, num_kv_heads=num_kv_heads, tp=tp)


def tokens_in_room(room_bytes: float, *, kv_bytes_per_token: int, num_kv_heads: int, tp: int) -> int:
    """Tokens of KV that `room_bytes` on each device of a TP=`tp` replica hold: each device keeps
    ceil(num_kv_heads / tp) of the heads of every token (`kv_bytes_per_token` counts all heads, K and V, every
    layer), so a TPk replica holds k times the tokens of a TP1 one in the same room per device (while
    k <= num_kv_heads)."""
    if kv_bytes_per_token < 1 or num_kv_heads < 1 or tp < 1:
        raise ValueError(f"kv_bytes_per_token={kv_bytes_per_token}, num_kv_heads={num_kv_heads} and tp={tp} "
                         f"must be >= 1")
    per_device_token = kv_bytes_per_token * math.ceil(num_kv_heads / tp) / num_kv_heads
    return int(room_bytes // per_device_token)


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks (pages) `num_tokens` tokens occupy with pages of `block_size` tokens."""
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    return -(-num_tokens // block_size)


def stock_kv_tokens(mem: MemorySpec, *, param_bytes: float, kv_bytes_per_token: int, num_kv_heads: int,
                    tps: Sequence[int]) -> dict[int, int]:
    """Tokens one replica of each TP holds in a stock engine launched at that TP (weights / tp per device)."""
    return {tp: replica_kv_tokens(mem, param_bytes=param_bytes, kv_bytes_per_token=kv_bytes_per_token,
                                  num_kv_heads=num_kv_heads, tp=tp) for tp in tps}


def pool_kv_tokens(mem: MemorySpec, *, param_bytes: float, kv_bytes_per_token: int, num_kv_heads: int,
                   tps: Sequence[int], base_tp: int | None = None) -> dict[int, int]:
    """Tokens one replica of each TP holds in the SGLang pool: the KV storage allocated at the base layout
    (`base_tp`, default the smallest of `tps`: full base-layout weights kept on every device in every layout),
    re-viewed for each TP's heads per device."""
    base = min(tps) if base_tp is None else base_tp
    room = kv_room_bytes(mem, param_bytes=param_bytes, tp=base)
    if room <= 0:
        replica_kv_tokens(mem, param_bytes=param_bytes, kv_bytes_per_token=kv_bytes_per_token,
                          num_kv_heads=num_kv_heads, tp=base)  # raises, naming every operand
    return {tp: tokens_in_room(room, kv_bytes_per_token=kv_bytes_per_token, num_kv_heads=num_kv_heads, tp=tp)
            for tp in tps}


def reclaim_room_bytes(base_room_bytes: float, *, freed_bytes: float, loss_bytes: float = 0.0) -> float:
    """KV bytes per device of a layout of the reclaiming pool: the base layout's room plus the weight bytes the
    layout frees, less what granule rounding keeps back (`vmem.ReclaimPlan`: freed_bytes, loss_bytes)."""
    if freed_bytes < 0 or not 0 <= loss_bytes <= freed_bytes:
        raise ValueError(f"freed_bytes={freed_bytes} must be >= 0 and loss_bytes={loss_bytes} in [0, freed_bytes]")
    return base_room_bytes + freed_bytes - loss_bytes


def reclaim_kv_tokens(mem: MemorySpec, *, param_bytes: float, kv_bytes_per_token: int, num_kv_heads: int,
                      tps: Sequence[int], base_tp: int | None = None,
                      loss_bytes: Mapping[int, float] | None = None) -> dict[int, int]:
    """Tokens one replica of each TP holds in the reclaiming SGLang pool: the base room (`base_tp`, default the
    smallest of `tps`) plus weights / base - weights / tp per device, less `loss_bytes[tp]` (granule rounding; None:
    no loss, the stock engine's room at every TP)."""
    base = min(tps) if base_tp is None else base_tp
    room = kv_room_bytes(mem, param_bytes=param_bytes, tp=base)
    if room <= 0:
        replica_kv_tokens(mem, param_bytes=param_bytes, kv_bytes_per_token=kv_bytes_per_token,
                          num_kv_heads=num_kv_heads, tp=base)  # raises, naming every operand
    loss = loss_bytes or {}
    return {tp: tokens_in_room(reclaim_room_bytes(room, freed_bytes=param_bytes / base - param_bytes / tp,
                                                  loss_bytes=loss.get(tp, 0.0)),
                               kv_bytes_per_token=kv_bytes_per_token, num_kv_heads=num_kv_heads, tp=tp)
            for tp in tps}


def block_pool_kv_tokens(*, num_kv_blocks: int, block_size: int, tps: Sequence[int]) -> dict[int, int]:
    """Tokens one replica of each TP holds in the reference engine's pool: `num_kv_blocks` blocks of `block_size`
    tokens per rank, every rank holding its share of the heads of every token (engine/ref/block_manager.py)."""
    if num_kv_blocks < 1 or block_size < 1:
        raise ValueError(f"num_kv_blocks={num_kv_blocks} and block_size={block_size} must be >= 1")
    return {tp: num_kv_blocks * block_size for tp in tps}


ROOMS = ("stock", "sglang-pool", "sglang-pool-reclaim", "ref-pool")


def layout_kv_tokens(room: str, mem: MemorySpec, *, param_bytes: float, kv_bytes_per_token: int, num_kv_heads: int,
                     tps: Sequence[int]) -> dict[int, int]:
    """Tokens per replica of each TP under backend `room` ("stock", "sglang-pool" or "sglang-pool-reclaim"
    (without rounding loss: `reclaim_kv_tokens`); the reference pool's room is its block count:
    `block_pool_kv_tokens`)."""
    kw = dict(param_bytes=param_bytes, kv_bytes_per_token=kv_bytes_per_token, num_kv_heads=num_kv_heads, tps=tps)
    if room == "stock":
        return stock_kv_tokens(mem, **kw)
    if room == "sglang-pool":
        return pool_kv_tokens(mem, **kw)
    if room == "sglang-pool-reclaim":
        return reclaim_kv_tokens(mem, **kw)
    raise ValueError(f"room={room!r}: expected 'stock', 'sglang-pool' or 'sglang-pool-reclaim' (the ref pool: "
                     f"block_pool_kv_tokens)")
