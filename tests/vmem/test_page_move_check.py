"""The GPU test's scenario (`vmem.check.page_move_check`) on the CPU: a FakeMapper with bytes behind each handle,
so what the scenario reads back shows the pages themselves moved (their bytes travel with them)."""

from __future__ import annotations

import pytest

from pat_rollout.vmem import FakeMapper, ReclaimError
from pat_rollout.vmem.check import page_move_check, pattern

G = 4096


class MemoryMapper(FakeMapper):
    """FakeMapper whose handles hold bytes; reads and writes go through the current mapping (a fault otherwise)."""

    def __init__(self, granule: int, budget_bytes: int):
        super().__init__(granule, budget_bytes)
        self.data: dict[int, bytearray] = {}

    def create(self, nbytes: int) -> int:
        h = super().create(nbytes)
        self.data[h] = bytearray(nbytes)
        return h

    def release(self, handle: int) -> None:
        super().release(handle)
        del self.data[handle]

    def _at(self, va: int, n: int) -> tuple[bytearray, int]:
        for m, h in self.maps.items():
            if m <= va and va + n <= m + self.handles[h]:
                return self.data[h], va - m
        raise ReclaimError(f"fault: [{va:#x}, {va + n:#x}) is not mapped")

    def read(self, va: int, n: int) -> bytes:
        buf, off = self._at(va, n)
        return bytes(buf[off : off + n])

    def write(self, va: int, b: bytes) -> None:
        buf, off = self._at(va, len(b))
        buf[off : off + len(b)] = b


def test_page_move_check_on_fake_memory():
    m = MemoryMapper(G, budget_bytes=64 * G)
    seen = page_move_check(m, m.read, m.write, lambda: m.budget_bytes - m.physical_bytes())
    assert seen["order"] == [2, 3, 1]
    assert seen["grow_kv"] == [True] * 3 and seen["shrink_weights"] == [True] * 3
    assert seen["head_kept"] and seen["kv_base_kept"]
    assert "shrink tp 4 -> 1: KV region 0 holds live KV up to byte 8192 but keeps only 4096 mapped" in seen["refused"]
    # start-up allocates 4 weight pages + 1 KV base page; the grow and the shrink allocate nothing; close frees all
    assert seen["free"] == [64 * G, 59 * G, 59 * G, 59 * G, 64 * G]
    assert m.peak_physical == 5 * G and m.maps == {} and m.handles == {}


def test_reading_an_address_whose_page_was_lent_faults():
    m = MemoryMapper(G, budget_bytes=64 * G)
    from pat_rollout.vmem import KvRegion, ReclaimPlan, WeightStorage, apply_switch, map_initial

    w, k = m.reserve(2 * G), m.reserve(2 * G)
    plan = ReclaimPlan.build(weights=[WeightStorage(name="w", start=w, nbytes=2 * G, kept={1: 2 * G, 2: G})],
                             kv=[KvRegion(start=k, base_bytes=G, reserved_bytes=2 * G)], tps=(1, 2), granule=G)
    handles = map_initial(plan, m)
    m.write(w + G, pattern(7, G))
    apply_switch(plan, m, handles, 1, 2, kv_used_bytes=[G])
    with pytest.raises(ReclaimError, match="fault"):
        m.read(w + G, G)
    assert m.read(k + G, G) == pattern(7, G)
