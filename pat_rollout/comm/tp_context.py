"""TPContext: the tensor-parallel group a layer computes in, passed explicitly and rebindable."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@dataclass(frozen=True, slots=True)
class TPContext:
    """TP rank `rank` of a group of `size` ranks. `group` None means torch's default group (only
    consulted when size > 1). Collectives are no-ops at size 1, so TP=1 needs no torch.distributed.

    `global_ranks[r]` is the global rank holding TP rank r. Process groups are shared by every
    layout over the same devices, and torch numbers group members by global rank, so when the TP
    order differs from that (in-place layout transitions) all_gather reorders to TP order.
    None means TP rank == group rank.
    """

    rank: int = 0
    size: int = 1
    group: ProcessGroup | None = None
    global_ranks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tp_rank={self.rank} out of range for tp_size={self.size}")
        if self.global_ranks is not None:
            object.__setattr__(self, "global_ranks", tuple(self.global_ranks))
            if len(self.global_ranks) != self.size or len(set(self.global_ranks)) != self.size:
                raise ValueError(f"global_ranks={self.global_ranks} must list {self.size} distinct ranks")

    @classmethod
    def from_group(cls, group: ProcessGroup | None = None) -> TPContext:
        """The calling process's context in `group` (default group when None)."""
        return cls(rank=dist.get_rank(group), size=dist.get_world_size(group), group=group)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the group in place; returns `t`."""
        if self.size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `t` along `dim`, in rank order."""
        if self.size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)  # parts in group-rank order
        if self.global_ranks is not None:
            group_rank = {g: i for i, g in enumerate(sorted(self.global_ranks))}
            parts = [parts[group_rank[g]] for g in self.global_ranks]
        return torch.cat(parts, dim=dim)
