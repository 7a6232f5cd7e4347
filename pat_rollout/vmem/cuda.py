"""`CudaMapper`: the `Mapper` protocol on the CUDA driver's virtual memory API (cuMemAddressReserve, cuMemCreate,
cuMemMap, cuMemSetAccess, cuMemUnmap, cuMemRelease, cuMemAddressFree), called through ctypes on libcuda.so.1.

Why ctypes: the lent GPU machines have torch (which loads libcuda) but not cuda-python, and no network; the seven
calls and two structs are stable driver ABI since CUDA 10.2. torch_memory_saver (in the SGLang venv) maps whole
allocations only (pause/resume by tag, one handle per allocation): it cannot unmap part of a region, which is
the point here. Nothing is loaded at import; `CudaMapper()` loads the driver and needs a current context (torch
makes the primary context current on first CUDA use)."""

from __future__ import annotations

import ctypes

from pat_rollout.vmem.mapper import MapperLedger


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_PINNED, _LOCATION_DEVICE, _READWRITE, _GRANULARITY_MINIMUM = 1, 1, 3, 0
_u64, _size = ctypes.c_ulonglong, ctypes.c_size_t


class CudaError(RuntimeError):
    pass


class CudaMapper(MapperLedger):
    """Reserve / create / map / unmap / release on one device, tracking what it made so `close()` undoes it all."""

    def __init__(self, device: int = 0, lib: str = "libcuda.so.1"):
        self._cu = ctypes.CDLL(lib)
        self.device = device
        self._call("cuInit", ctypes.c_uint(0))
        self.prop = _AllocationProp(type=_PINNED, requestedHandleTypes=0, location=_Location(_LOCATION_DEVICE, device))
        self.access = _AccessDesc(location=_Location(_LOCATION_DEVICE, device), flags=_READWRITE)
        g = _size(0)
        self._call("cuMemGetAllocationGranularity", ctypes.byref(g), ctypes.byref(self.prop),
                   ctypes.c_int(_GRANULARITY_MINIMUM))
        self.granule = int(g.value)
        self.reservations: dict[int, int] = {}
        self.handles: dict[int, int] = {}  # handle -> nbytes
        self.maps: dict[int, int] = {}  # va -> handle

    def _call(self, name: str, *args) -> None:
        rc = getattr(self._cu, name)(*args)
        if rc != 0:
            msg = ctypes.c_char_p()
            self._cu.cuGetErrorString(ctypes.c_int(rc), ctypes.byref(msg))
            raise CudaError(f"{name} failed: CUresult {rc} ({(msg.value or b'?').decode()})")

    def reserve(self, nbytes: int) -> int:
        ptr = _u64(0)
        self._call("cuMemAddressReserve", ctypes.byref(ptr), _size(nbytes), _size(self.granule), _u64(0), _u64(0))
        self.reservations[ptr.value] = nbytes
        return int(ptr.value)

    def create(self, nbytes: int) -> int:
        h = _u64(0)
        self._call("cuMemCreate", ctypes.byref(h), _size(nbytes), ctypes.byref(self.prop), _u64(0))
        self._add_handle(h.value, nbytes)
        return int(h.value)

    def map(self, va: int, handle: int) -> None:
        n = self.handles[handle]
        self._call("cuMemMap", _u64(va), _size(n), _size(0), _u64(handle), _u64(0))
        try:
            self._call("cuMemSetAccess", _u64(va), _size(n), ctypes.byref(self.access), _size(1))
        except CudaError:
            self._call("cuMemUnmap", _u64(va), _size(n))
            raise
        self.maps[va] = handle

    def unmap(self, va: int, nbytes: int) -> None:
        self._call("cuMemUnmap", _u64(va), _size(nbytes))
        del self.maps[va]

    def release(self, handle: int) -> None:
        self._call("cuMemRelease", _u64(handle))
        del self.handles[handle]

    def close(self) -> None:
        """Unmap, release and free everything this mapper made (the caller synchronized the device)."""
        self._unmap_and_release_all()
        for va, n in list(self.reservations.items()):
            self._call("cuMemAddressFree", _u64(va), _size(n))
            del self.reservations[va]


def torch_bytes(va: int, nbytes: int, device: int = 0):
    """A torch uint8 tensor over [va, va + nbytes) of mapped device memory (no copy; it must not outlive the
    mapping)."""
    import torch

    class _View:
        __cuda_array_interface__ = dict(shape=(nbytes,), typestr="|u1", data=(va, False), version=3, strides=None)

    with torch.cuda.device(device):
        return torch.as_tensor(_View(), device=f"cuda:{device}")
