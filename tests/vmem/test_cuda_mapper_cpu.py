"""The CPU-checkable parts of vmem.cuda.CudaMapper: the ctypes structs have cuda.h's layout (CUDA 12/13:
CUmemAllocationProp 32 bytes, location at 8, allocFlags at 24; CUmemAccessDesc 12 bytes), driver errors are
named, and the calls go out with the driver's argument order (a recording stand-in for libcuda)."""

from __future__ import annotations

import ctypes

import pytest

from pat_rollout.vmem import cuda
from pat_rollout.vmem.plan import CUDA_GRANULE


def test_struct_layouts_match_cuda_h():
    assert ctypes.sizeof(cuda._AllocationProp) == 32
    assert cuda._AllocationProp.location.offset == 8 and cuda._AllocationProp.win32HandleMetaData.offset == 16
    assert cuda._AllocationProp.allocFlags.offset == 24
    assert ctypes.sizeof(cuda._AccessDesc) == 12 and cuda._AccessDesc.flags.offset == 8


class FakeDriver:
    """Records (name, args) of each call; `fail` names a call that returns CUresult 2 (out of memory)."""

    def __init__(self, fail: str = ""):
        self.calls, self.fail, self.next = [], fail, 0x7F0000000000

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, args))
            if name == "cuGetErrorString":
                args[1]._obj.value = b"out of memory"
                return 0
            if name == self.fail:
                return 2
            if name == "cuMemGetAllocationGranularity":
                args[0]._obj.value = CUDA_GRANULE
            if name in ("cuMemAddressReserve", "cuMemCreate"):
                args[0]._obj.value = self.next
                self.next += 1 << 30
            return 0
        return call


def _mapper(driver: FakeDriver) -> cuda.CudaMapper:
    m = cuda.CudaMapper.__new__(cuda.CudaMapper)
    m._cu = driver
    m.device = 0
    m.prop = cuda._AllocationProp(type=1, location=cuda._Location(1, 0))
    m.access = cuda._AccessDesc(location=cuda._Location(1, 0), flags=3)
    m.granule, m.reservations, m.handles, m.maps = CUDA_GRANULE, {}, {}, {}
    return m


def test_calls_and_bookkeeping_on_a_recording_driver():
    d = FakeDriver()
    m = _mapper(d)
    va, h = m.reserve(4 * CUDA_GRANULE), m.create(CUDA_GRANULE)
    m.map(va, h)
    assert (m.physical_bytes(), m.mapped_bytes()) == (CUDA_GRANULE, CUDA_GRANULE)
    name, args = d.calls[-2]
    assert name == "cuMemMap" and [a.value for a in args] == [va, CUDA_GRANULE, 0, h, 0]
    assert d.calls[-1][0] == "cuMemSetAccess"
    m.close()
    assert [c[0] for c in d.calls[-3:]] == ["cuMemUnmap", "cuMemRelease", "cuMemAddressFree"]
    assert m.maps == m.handles == m.reservations == {}


def test_a_failed_set_access_unmaps_and_names_the_error():
    m = _mapper(FakeDriver(fail="cuMemSetAccess"))
    va, h = m.reserve(CUDA_GRANULE), m.create(CUDA_GRANULE)
    with pytest.raises(cuda.CudaError, match=r"cuMemSetAccess failed: CUresult 2 \(out of memory\)"):
        m.map(va, h)
    assert m._cu.calls[-1][0] == "cuMemUnmap" and m.maps == {}


def test_no_driver_here_is_an_os_error():
    with pytest.raises(OSError):
        cuda.CudaMapper(lib="libcuda-that-does-not-exist.so.1")
