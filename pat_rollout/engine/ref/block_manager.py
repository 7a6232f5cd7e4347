"""Free list of fixed-size KV blocks and the slot arithmetic of block tables (no tensors)."""

from __future__ import annotations

from collections import deque

from pat_rollout.engine.ref.sequence import Sequence


class BlockManager:
    """Token position p of a sequence lives in pool slot block_table[p // block_size] * block_size
    + p % block_size. Blocks are not shared between sequences (no prefix caching)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` still needs to hold `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        missing = self.num_missing(seq, num_tokens)
        assert missing <= self.num_free, f"{seq.request_id}: {missing} blocks needed, {self.num_free} free"
        seq.block_table.extend(self.free_blocks.popleft() for _ in range(missing))

    def free(self, seq: Sequence) -> None:
        self.free_blocks.extend(seq.block_table)
        seq.block_table = []

    def slots(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Pool slots of positions [0, num_tokens), in order."""
        bs = self.block_size
        return [seq.block_table[p // bs] * bs + p % bs for p in range(num_tokens)]
