"""`vmem.host.HostMapper`: the Mapper protocol on Linux host memory (mmap reservations, memfd pages). The pages
really move: bytes written through a torch view at one address are read at the other; the kept head is unchanged;
physical bytes are the handles' (the memfd's allocated blocks, read back from the kernel); the FakeMapper's
refusals hold before any system call; the GPU test's scenario (`vmem.check.page_move_check`) passes on it."""

from __future__ import annotations

import sys

import pytest

torch = pytest.importorskip("torch")

if not sys.platform.startswith("linux"):
    pytest.skip("HostMapper is Linux only", allow_module_level=True)

from pat_rollout.vmem import KvRegion, ReclaimError, ReclaimPlan, WeightStorage, apply_switch, map_initial  # noqa
from pat_rollout.vmem.check import page_move_check, pattern  # noqa: E402
from pat_rollout.vmem.host import HostMapper, torch_bytes  # noqa: E402

G = 64 << 10


@pytest.fixture
def mapper():
    m = HostMapper(G)
    yield m
    m.close()


def _read(va: int, n: int) -> bytes:
    return torch_bytes(va, n).numpy().tobytes()


def _write(va: int, b: bytes) -> None:
    torch_bytes(va, len(b)).copy_(torch.frombuffer(bytearray(b), dtype=torch.uint8))


def test_a_moved_page_carries_its_bytes_and_the_kept_head_is_unchanged(mapper):
    w, k = mapper.reserve(4 * G), mapper.reserve(3 * G)
    plan = ReclaimPlan.build(weights=[WeightStorage(name="w", start=w, nbytes=4 * G, kept={1: 4 * G, 2: 2 * G})],
                             kv=[KvRegion(start=k, base_bytes=G, reserved_bytes=3 * G)], tps=(1, 2), granule=G)
    handles = map_initial(plan, mapper)
    weights = torch_bytes(w, 4 * G)  # one tensor over the whole storage, as a parameter is
    weights.copy_(torch.arange(4 * G, dtype=torch.int64).remainder(251).to(torch.uint8))
    before = weights.clone()
    _write(k, pattern(9, G))
    apply_switch(plan, mapper, handles, 1, 2, kv_used_bytes=[G])
    assert _read(k + G, 2 * G) == before[2 * G :].numpy().tobytes()  # the tail pages, now in the KV range
    assert torch.equal(weights[: 2 * G], before[: 2 * G])  # the kept head, read through the old tensor
    assert _read(k, G) == pattern(9, G)
    _write(k + G, pattern(3, 2 * G))  # KV writes into the lent pages ...
    apply_switch(plan, mapper, handles, 2, 1, kv_used_bytes=[G])
    assert weights[2 * G :].numpy().tobytes() == pattern(3, 2 * G)  # ... come back under the weight addresses
    assert torch.equal(weights[: 2 * G], before[: 2 * G])


def test_physical_bytes_are_the_handles_and_the_kernel_agrees(mapper):
    w, k = mapper.reserve(4 * G), mapper.reserve(3 * G)
    plan = ReclaimPlan.build(weights=[WeightStorage(name="w", start=w, nbytes=4 * G, kept={1: 4 * G, 2: 2 * G})],
                             kv=[KvRegion(start=k, base_bytes=G, reserved_bytes=3 * G)], tps=(1, 2), granule=G)
    assert mapper.physical_bytes() == 0 and mapper.resident_bytes() == 0  # a reservation holds no memory
    handles = map_initial(plan, mapper)
    torch_bytes(w, 4 * G).fill_(1)
    torch_bytes(k, G).fill_(2)
    assert mapper.physical_bytes() == mapper.resident_bytes() == 5 * G == len(mapper.handles) * G
    apply_switch(plan, mapper, handles, 1, 2, kv_used_bytes=[G])
    assert mapper.physical_bytes() == mapper.resident_bytes() == 5 * G  # moved, nothing allocated or freed
    assert mapper.mapped_in(k, 3 * G) == 3 * G and mapper.mapped_in(w, 4 * G) == 2 * G
    apply_switch(plan, mapper, handles, 2, 1, kv_used_bytes=[G])
    mapper.unmap(w + 3 * G, G)
    mapper.release(handles[w + 3 * G])
    assert mapper.physical_bytes() == mapper.resident_bytes() == 4 * G  # released: back to the kernel


def test_the_fake_mappers_refusals_hold_before_any_system_call(mapper):
    w = mapper.reserve(2 * G)
    h = mapper.create(G)
    with pytest.raises(ReclaimError, match="multiple of"):
        mapper.reserve(G + 1)
    with pytest.raises(ReclaimError, match="not granule-aligned inside one reservation"):
        mapper.map(w + 2 * G, h)  # past the reservation
    mapper.map(w, h)
    with pytest.raises(ReclaimError, match="already mapped"):
        mapper.map(w + G, h)  # a handle twice: weights and KV would alias
    h2 = mapper.create(G)
    with pytest.raises(ReclaimError, match="overlaps"):
        mapper.map(w, h2)
    with pytest.raises(ReclaimError, match="still mapped"):
        mapper.release(h)
    with pytest.raises(ReclaimError, match="no mapping of exactly that range"):
        mapper.unmap(w + G, G)
    _write(w, pattern(1, G))
    assert _read(w, G) == pattern(1, G)  # the refused calls changed nothing
    with pytest.raises(ReclaimError, match="page size"):
        HostMapper(1000)
    budget = HostMapper(G, budget_bytes=G)
    try:
        budget.create(G)
        with pytest.raises(ReclaimError, match="out of memory"):
            budget.create(G)
    finally:
        budget.close()


def test_page_move_check_on_host_memory(mapper):
    seen = page_move_check(mapper, _read, _write, lambda: -mapper.physical_bytes())
    assert seen["order"] == [2, 3, 1]
    assert seen["grow_kv"] == [True] * 3 and seen["shrink_weights"] == [True] * 3
    assert seen["head_kept"] and seen["kv_base_kept"]
    assert "shrink tp 4 -> 1: KV region 0 holds live KV" in seen["refused"]
    assert seen["free"] == [0, -5 * G, -5 * G, -5 * G, 0]
    assert mapper.maps == {} and mapper.handles == {} and mapper.fd == -1
