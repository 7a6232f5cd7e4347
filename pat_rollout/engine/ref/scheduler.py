"""Continuous-batching scheduler: waiting queue, running list (admission order), preemption."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pat_rollout.engine.ref.block_manager import BlockManager
from pat_rollout.engine.ref.sequence import Sequence


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    seqs: tuple[Sequence, ...]
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preempted: int


class Scheduler:
    """Every rank of a TP group runs an identical scheduler on identical calls, so all ranks
    pick the same batch without communication."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_prefill_tokens: int) -> None:
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest admission first

    def schedule(self) -> ScheduledBatch:
        """Reserve a KV slot for every running sequence's next token (preempting the most recently
        admitted ones back to waiting when blocks run out), then admit waiting sequences."""
        kept: list[Sequence] = []
        queue = list(self.running)
        num_preempted = 0
        while queue:
            seq = queue.pop(0)
            need = self.blocks.num_missing(seq, seq.num_tokens)
            while need > self.blocks.num_free and queue:
                self.preempt(queue.pop())
                num_preempted += 1
            if need > self.blocks.num_free:  # nothing newer left to evict: wait, recompute later
                self.preempt(seq)
                num_preempted += 1
                continue
            self.blocks.allocate(seq, seq.num_tokens)
            kept.append(seq)
        num_decode = sum(s.num_tokens - s.num_cached for s in kept)
        self.running = kept
        num_prefill = 0
        # No admission right after a preemption: the freed blocks are what running sequences need next.
        while self.waiting and not num_preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_new = seq.num_tokens - seq.num_cached
            if num_prefill and num_prefill + num_new > self.max_prefill_tokens:
                break
            if self.blocks.num_missing(seq, seq.num_tokens) > self.blocks.num_free:
                break
            self.waiting.popleft()
            self.blocks.allocate(seq, seq.num_tokens)
            self.running.append(seq)
            num_prefill += num_new
        return ScheduledBatch(seqs=tuple(self.running), num_prefill_tokens=num_prefill, num_decode_tokens=num_decode,
                              num_preempted=num_preempted)

    def preempt(self, seq: Sequence) -> None:
        # Preempted newest-first; appendleft therefore keeps the waiting queue in admission order.
        self.blocks.free(seq)
        seq.num_cached = 0
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)

    def remove(self, request_ids: set[str] | None) -> list[Sequence]:
        """Take sequences out of scheduling (all when None), running first, keeping their blocks."""
        taken = [s for s in (*self.running, *self.waiting) if request_ids is None or s.request_id in request_ids]
        ids = {id(s) for s in taken}
        self.running = [s for s in self.running if id(s) not in ids]
        self.waiting = deque(s for s in self.waiting if id(s) not in ids)
        return taken
