"""Process groups for every layout the planner may use, created once and reused.

Creating and destroying communicators per reconfiguration is slow on NCCL and leaks in SGLang
(pynccl communicators are never freed), so every TP group any reachable layout needs is built at
start-up, collectively, in the same order on every rank. A switch is then a dictionary lookup.
Groups are keyed by the *set* of devices: the same devices in another TP-rank order share one
communicator (torch orders group ranks by global rank; TPContext maps TP rank -> group rank).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from pat_rollout.layout import Layout

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GroupHandle:
    ranks: tuple[int, ...]  # global ranks, sorted (torch's group-rank order)
    backend: str
    pg: Any  # torch ProcessGroup, or None when this rank is not a member
    generation: int


@dataclass(slots=True)
class GroupCache:
    """All TP groups of a set of layouts. `get` never creates: a miss is a planning bug."""

    backend: str
    timeout: Any = None  # datetime.timedelta for every group's collectives (None: torch's default)
    generation: int = 0
    _groups: dict[frozenset[int], GroupHandle] = field(default_factory=dict)
    num_created: int = 0
    num_hits: int = 0

    def build(self, layouts: Iterable[Layout]) -> None:
        """Create every group of `layouts` not yet cached. Collective over the world: call it with
        the same layouts, in the same order, on every rank."""
        device_sets = sorted({frozenset(g) for layout in layouts for g in layout.groups}, key=lambda s: sorted(s))
        for devices in device_sets:
            if devices in self._groups:
                continue
            ranks = tuple(sorted(devices))
            # Every rank must call new_group for every group, members or not (torch requirement).
            pg = dist.new_group(ranks=list(ranks), backend=self.backend, timeout=self.timeout) if len(ranks) > 1 \
                else None
            member = dist.get_rank() in devices
            self._groups[devices] = GroupHandle(ranks, self.backend, pg if member else None, self.generation)
            self.num_created += 1
        logger.info("group cache holds %d groups (%d created)", len(self._groups), self.num_created)

    def get(self, devices: Iterable[int]) -> GroupHandle:
        key = frozenset(devices)
        handle = self._groups.get(key)
        if handle is None:
            raise RuntimeError(
                f"no cached process group for devices {sorted(key)} (generation {self.generation}); "
                f"cached: {[sorted(k) for k in self._groups]}. Groups must be built at start-up for every layout."
            )
        self.num_hits += 1
        return handle

    def handles(self) -> dict[frozenset[int], GroupHandle]:
        """A copy of the cache: device set -> handle (for introspection and tests)."""
        return dict(self._groups)

    def __len__(self) -> int:
        return len(self._groups)

    def close(self) -> None:
        """Destroy the cached groups (only at shutdown)."""
        for handle in self._groups.values():
            if handle.pg is not None:
                dist.destroy_process_group(handle.pg)
        self._groups.clear()
        self.generation += 1
