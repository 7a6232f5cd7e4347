"""The per-rank paged KV pool: one tensor for all layers plus the free list of its blocks."""

from __future__ import annotations

import torch

from pat_rollout.engine.ref.block_manager import BlockManager
from pat_rollout.engine.ref.sequence import Sequence


class KVCache:
    """pool is [num_layers, 2 (K, V), num_blocks * block_size slots, local KV heads, head_dim];
    None while released. The block count is fixed; the head count follows the TP layout."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> None:
        self.blocks = BlockManager(num_blocks, block_size)
        self.num_layers, self.num_kv_heads, self.head_dim, self.dtype = num_layers, num_kv_heads, head_dim, dtype
        self.pool: torch.Tensor | None = None
        self.allocate()

    def allocate(self) -> None:
        self.pool = torch.zeros(self.num_layers, 2, self.blocks.num_blocks * self.blocks.block_size,
                                self.num_kv_heads, self.head_dim, dtype=self.dtype)

    def release(self) -> None:
        self.pool = None

    def set_num_kv_heads(self, num_kv_heads: int) -> None:
        """Re-allocate for another TP layout (contents are dropped: callers hold no requests)."""
        self.num_kv_heads = num_kv_heads
        if self.pool is not None:
            self.allocate()

    def _slots(self, seq: Sequence, num_tokens: int) -> torch.Tensor:
        return torch.tensor(self.blocks.slots(seq, num_tokens), dtype=torch.long)

    def read(self, seq: Sequence, num_tokens: int, heads: tuple[int, int]) -> torch.Tensor:
        """K/V of positions [0, num_tokens) for local heads [lo, hi): [L, 2, num_tokens, hi - lo, D]."""
        assert self.pool is not None
        return self.pool[:, :, self._slots(seq, num_tokens), heads[0] : heads[1]].contiguous()

    def write(self, seq: Sequence, kv: torch.Tensor) -> None:
        """Store kv [L, 2, T, local heads, D] as positions [0, T) of `seq` (blocks already allocated)."""
        assert self.pool is not None
        with torch.no_grad():
            self.pool[:, :, self._slots(seq, kv.shape[2])] = kv.to(self.dtype)
