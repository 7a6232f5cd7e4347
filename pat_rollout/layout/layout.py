"""A rollout layout: DP replicas, each a TP group of devices in TP-rank order."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Layout:
    """`groups[i]` lists the devices of replica i; position in the tuple is the TP rank.

    Example: Layout(((0,), (1,))) is 2 x TP=1; Layout(((0, 1),)) is 1 x TP=2.
    """

    groups: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not self.groups or any(not g for g in self.groups):
            raise ValueError(f"layout {self.groups} has an empty group")
        sizes = {len(g) for g in self.groups}
        if len(sizes) != 1:
            raise ValueError(f"layout {self.groups}: all TP groups must have the same size, got sizes {sorted(sizes)}")
        devices = [d for g in self.groups for d in g]
        if len(set(devices)) != len(devices):
            raise ValueError(f"layout {self.groups} lists a device twice")

    @classmethod
    def uniform(cls, num_devices: int, tp_size: int) -> Layout:
        """num_devices / tp_size replicas of consecutive devices."""
        if tp_size <= 0 or num_devices % tp_size:
            raise ValueError(f"tp_size={tp_size} must divide num_devices={num_devices}")
        return cls(tuple(tuple(range(r * tp_size, (r + 1) * tp_size)) for r in range(num_devices // tp_size)))

    @property
    def tp_size(self) -> int:
        return len(self.groups[0])

    @property
    def num_replicas(self) -> int:
        return len(self.groups)

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(sorted(d for g in self.groups for d in g))

    def position(self, device: int) -> tuple[int, int]:
        """(replica index, tp rank) of `device`."""
        for r, g in enumerate(self.groups):
            if device in g:
                return r, g.index(device)
        raise ValueError(f"device {device} is not in layout {self.groups}")

    def __str__(self) -> str:
        return f"{self.num_replicas}xTP{self.tp_size}" + str(list(map(list, self.groups))).replace(" ", "")
