"""Mapping backends for a `ReclaimPlan`: the `Mapper` protocol (the CUDA driver's virtual memory calls, reduced to
what a plan needs), `FakeMapper` (CPU, records every step) and the functions that run a plan on a mapper. Pure
stdlib; `vmem.cuda.CudaMapper` is the GPU backend."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pat_rollout.vmem.plan import ReclaimError, ReclaimPlan


class Mapper(Protocol):
    """reserve(nbytes) -> address of a reserved, unmapped range; create(nbytes) -> physical handle (allocates);
    map(va, handle) maps the whole handle at va (inside a reservation, nothing mapped there); unmap(va, nbytes)
    removes exactly one earlier mapping; release(handle) frees an unmapped handle; physical_bytes() -> bytes of
    live handles; mapped_bytes() -> bytes mapped."""

    granule: int

    def reserve(self, nbytes: int) -> int: ...

    def create(self, nbytes: int) -> int: ...

    def map(self, va: int, handle: int) -> None: ...

    def unmap(self, va: int, nbytes: int) -> None: ...

    def release(self, handle: int) -> None: ...

    def physical_bytes(self) -> int: ...

    def mapped_bytes(self) -> int: ...


class MapperLedger:
    """What a mapper made: `handles` (handle -> bytes) and `maps` (address -> handle), the byte counts derived from
    them, and undoing every mapping and handle in order (unmap before release). Shared by FakeMapper (and so
    HostMapper) and vmem.cuda.CudaMapper; each frees its reservations its own way after `_unmap_and_release_all`."""

    handles: dict[int, int]
    maps: dict[int, int]
    peak_physical: int = 0  # the most bytes of live handles at any time

    def _add_handle(self, handle: int, nbytes: int) -> None:
        self.handles[handle] = nbytes
        self.peak_physical = max(self.peak_physical, self.physical_bytes())  # only a create adds physical bytes

    def physical_bytes(self) -> int:
        return sum(self.handles.values())

    def mapped_bytes(self) -> int:
        return sum(self.handles[h] for h in self.maps.values())

    def mapped_in(self, va: int, nbytes: int) -> int:
        """Mapped bytes inside [va, va + nbytes)."""
        return sum(self.handles[h] for m, h in self.maps.items() if va <= m and m + self.handles[h] <= va + nbytes)

    def _unmap_and_release_all(self) -> None:
        for va, h in list(self.maps.items()):
            self.unmap(va, self.handles[h])
        for h in list(self.handles):
            self.release(h)


class FakeMapper(MapperLedger):
    """A CPU stand-in with the CUDA driver's rules: maps only inside reservations, never over a mapping, never a
    handle that is already mapped (no aliasing: weights and KV must not share a page), unmaps only whole earlier
    mappings, releases only unmapped handles, and refuses to create past `budget_bytes` (out of memory). Records
    (op, address, mapped bytes, physical bytes) after every call in `history`, and the peak physical bytes."""

    def __init__(self, granule: int, budget_bytes: int | None = None, base: int = 1 << 40):
        self.granule = granule
        self.budget_bytes = budget_bytes
        self._next_va = base
        self._next_handle = 1
        self.reservations: list[tuple[int, int]] = []
        self.handles: dict[int, int] = {}  # handle -> nbytes
        self.maps: dict[int, int] = {}  # va -> handle
        self._where: dict[int, int] = {}  # handle -> va
        self.history: list[tuple[str, int, int, int]] = []
        self.peak_physical = 0

    def _log(self, op: str, va: int) -> None:
        self.history.append((op, va, self.mapped_bytes(), self.physical_bytes()))

    def reserve(self, nbytes: int) -> int:
        if nbytes <= 0 or nbytes % self.granule:
            raise ReclaimError(f"reserve({nbytes}): size must be a positive multiple of {self.granule}")
        va = self._new_range(nbytes)
        self.reservations.append((va, nbytes))
        self._log("reserve", va)
        return va

    def create(self, nbytes: int) -> int:
        if nbytes <= 0 or nbytes % self.granule:
            raise ReclaimError(f"create({nbytes}): size must be a positive multiple of {self.granule}")
        if self.budget_bytes is not None and self.physical_bytes() + nbytes > self.budget_bytes:
            raise ReclaimError(f"create({nbytes}): out of memory ({self.physical_bytes()} of {self.budget_bytes} B "
                               f"in use)")
        h = self._new_handle(nbytes)
        self._add_handle(h, nbytes)
        self._log("create", 0)
        return h

    def _new_range(self, nbytes: int) -> int:
        """The address of a new reservation (a subclass reserves real memory here)."""
        va = self._next_va
        self._next_va += nbytes + self.granule  # a gap: adjacent reservations are not one range
        return va

    def _new_handle(self, nbytes: int) -> int:
        """A new handle's id (a subclass allocates its physical memory here)."""
        h = self._next_handle
        self._next_handle += 1
        return h

    def _overlaps(self, va: int, nbytes: int) -> int | None:
        for m, h in self.maps.items():
            if m < va + nbytes and va < m + self.handles[h]:
                return m
        return None

    def map(self, va: int, handle: int) -> None:
        if handle not in self.handles:
            raise ReclaimError(f"map({va:#x}): unknown handle {handle}")
        n = self.handles[handle]
        if handle in self._where:
            raise ReclaimError(f"map({va:#x}): handle {handle} is already mapped at {self._where[handle]:#x}")
        if va % self.granule or not any(r <= va and va + n <= r + rn for r, rn in self.reservations):
            raise ReclaimError(f"map({va:#x}, {n} B): not granule-aligned inside one reservation")
        if (m := self._overlaps(va, n)) is not None:
            raise ReclaimError(f"map({va:#x}, {n} B): overlaps the mapping at {m:#x}")
        self.maps[va] = handle
        self._where[handle] = va
        self._log("map", va)

    def unmap(self, va: int, nbytes: int) -> None:
        h = self.maps.get(va)
        if h is None or self.handles[h] != nbytes:
            raise ReclaimError(f"unmap({va:#x}, {nbytes} B): no mapping of exactly that range")
        del self.maps[va]
        del self._where[h]
        self._log("unmap", va)

    def release(self, handle: int) -> None:
        if handle in self._where:
            raise ReclaimError(f"release({handle}): still mapped at {self._where[handle]:#x}")
        del self.handles[handle]
        self._log("release", 0)

    def close(self) -> None:
        """Unmap, release and free everything (as CudaMapper.close)."""
        self._unmap_and_release_all()
        self.reservations.clear()


def map_initial(plan: ReclaimPlan, mapper: Mapper) -> dict[int, int]:
    """The start-up mapping of the smallest layout (the plan's addresses must be ones `mapper` reserved): one handle
    per weight granule, mapped at home, and one handle per KV region's base. Returns weight page address ->
    handle (the handles `apply_switch` moves)."""
    handles = {}
    for va in plan.weight_pages():
        handles[va] = mapper.create(plan.granule)
        mapper.map(va, handles[va])
    for r in plan.kv:
        if r.base_bytes:
            mapper.map(r.start, mapper.create(r.base_bytes))
    return handles


def apply_switch(plan: ReclaimPlan, mapper: Mapper, handles: dict[int, int], src_tp: int, dst_tp: int, *,
                 kv_used_bytes: Sequence[int]) -> int:
    """Move the pages from the TP=src_tp mapping to TP=dst_tp's (`plan.steps`); returns the number of pages moved.
    A shrink is refused before any step (`ReclaimError`, nothing changed) while live KV lies in bytes it gives back
    (`plan.check_shrink`)."""
    plan.check_shrink(src_tp, dst_tp, kv_used_bytes)
    steps = plan.steps(src_tp, dst_tp)
    for s in steps:
        if s.op == "unmap":
            mapper.unmap(s.va, plan.granule)
        else:
            mapper.map(s.va, handles[s.page])
    return len(steps) // 2
