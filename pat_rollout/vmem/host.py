"""`HostMapper`: the `Mapper` protocol on Linux host memory, the CPU analogue of CUDA's virtual memory API, so the
reclaiming path runs for real on a CPU (pages really leave the weights and appear in the KV ranges).

- reserve(n): `mmap(NULL, n, PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)`: address range, no memory
  (touching it faults, as an unmapped CUDA VA does);
- create(n): a physical handle: n bytes of one memfd (`os.memfd_create`, grown with `ftruncate`; a handle is an
  offset into it). One file for all handles, not one per handle: a 4 KiB-granule plan of a small model already
  has more pages than a process's default file limit;
- map(va, h): `mmap(va, n, PROT_READ|PROT_WRITE, MAP_SHARED|MAP_FIXED, fd, offset(h))`: the handle's bytes appear at
  va (the same physical pages wherever it is mapped: a page moved carries its bytes);
- unmap(va, n): `mmap(va, n, PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_FIXED|MAP_NORESERVE)`: the range goes back to
  the reservation, the handle keeps its bytes;
- release(h): `fallocate(PUNCH_HOLE)` over the handle's bytes (the memory goes back to the kernel);
- close(): everything above undone, the reservations `munmap`ed, the file closed.

The rules (inside a reservation, never over a mapping, never a handle twice, whole mappings, unmapped releases,
budget) and the bookkeeping (`maps`, `handles`, `history`, `peak_physical`) are `FakeMapper`'s: a refusal is
raised before any system call. `torch_bytes(va, n)` views mapped bytes as a torch uint8 tensor (no copy).
Linux only (memfd, MAP_FIXED semantics); the granule must be a multiple of the system page size."""

from __future__ import annotations

import ctypes
import mmap
import os

from pat_rollout.vmem.mapper import FakeMapper
from pat_rollout.vmem.plan import ReclaimError

_PROT_NONE, _PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANON, _MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000  # Linux
_FALLOC_KEEP_SIZE, _FALLOC_PUNCH_HOLE = 0x01, 0x02

_libc = None


def _c():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                             ctypes.c_long]
        lib.munmap.restype = ctypes.c_int
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.fallocate.restype = ctypes.c_int
        lib.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
        _libc = lib
    return _libc


_MAP_FAILED = ctypes.c_void_p(-1).value


def _mmap(va: int, n: int, prot: int, flags: int, fd: int, off: int, what: str) -> int:
    got = _c().mmap(va or None, n, prot, flags, fd, off)
    if got is None or got == _MAP_FAILED:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: mmap({va:#x}, {n}) failed: {os.strerror(e)}")
    if va and got != va:
        raise OSError(f"{what}: mmap returned {got:#x} instead of {va:#x}")
    return int(got)


class HostMapper(FakeMapper):
    """FakeMapper's rules and bookkeeping, with real reservations, physical pages and mappings in this process."""

    def __init__(self, granule: int, budget_bytes: int | None = None):
        if granule <= 0 or granule % mmap.PAGESIZE:
            raise ReclaimError(f"HostMapper: granule {granule} must be a positive multiple of the page size "
                               f"{mmap.PAGESIZE}")
        super().__init__(granule, budget_bytes)
        self.fd = os.memfd_create("pat_rollout_vmem", os.MFD_CLOEXEC)
        self._file_bytes = 0
        self.offsets: dict[int, int] = {}  # handle -> offset in the memfd

    def _new_range(self, nbytes: int) -> int:
        """Granule-aligned (as cuMemAddressReserve's alignment): reserve one granule more, give back the ends."""
        g = self.granule
        raw = _mmap(0, nbytes + g, _PROT_NONE, _MAP_PRIVATE | _MAP_ANON | _MAP_NORESERVE, -1, 0, "reserve")
        va = -(-raw // g) * g
        for lo, n in ((raw, va - raw), (va + nbytes, raw + g - va)):
            if n and _c().munmap(lo, n) != 0:
                raise OSError(ctypes.get_errno(), f"reserve: munmap({lo:#x}, {n}) failed")
        return va

    def _new_handle(self, nbytes: int) -> int:
        h = super()._new_handle(nbytes)
        os.ftruncate(self.fd, self._file_bytes + nbytes)
        self.offsets[h] = self._file_bytes
        self._file_bytes += nbytes
        return h

    def map(self, va: int, handle: int) -> None:
        super().map(va, handle)  # the rules; refused before any system call
        try:
            _mmap(va, self.handles[handle], _PROT_RW, _MAP_SHARED | _MAP_FIXED, self.fd, self.offsets[handle], "map")
        except OSError:
            super().unmap(va, self.handles[handle])
            raise

    def unmap(self, va: int, nbytes: int) -> None:
        super().unmap(va, nbytes)
        _mmap(va, nbytes, _PROT_NONE, _MAP_PRIVATE | _MAP_ANON | _MAP_FIXED | _MAP_NORESERVE, -1, 0, "unmap")

    def release(self, handle: int) -> None:
        n, off = self.handles.get(handle), self.offsets.get(handle)
        super().release(handle)
        if _c().fallocate(self.fd, _FALLOC_PUNCH_HOLE | _FALLOC_KEEP_SIZE, off, n) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"release({handle}): fallocate(PUNCH_HOLE) failed: {os.strerror(e)}")
        del self.offsets[handle]

    def resident_bytes(self) -> int:
        """Bytes of physical memory the handles really hold (the memfd's allocated blocks: pages written at least
        once and not released)."""
        return os.fstat(self.fd).st_blocks * 512

    def close(self) -> None:
        if self.fd < 0:
            return
        reservations = list(self.reservations)
        super().close()
        for va, n in reservations:
            if _c().munmap(va, n) != 0:
                raise OSError(ctypes.get_errno(), f"close: munmap({va:#x}, {n}) failed")
        os.close(self.fd)
        self.fd = -1


def torch_bytes(va: int, nbytes: int):
    """A torch uint8 tensor over [va, va + nbytes) of host memory (no copy; it must not outlive the mapping, and
    touching bytes that are not mapped faults)."""
    import torch

    return torch.frombuffer((ctypes.c_char * nbytes).from_address(va), dtype=torch.uint8)
