"""GPU checks of `comm.device_groups` and `comm.abort` against real NCCL, torch only (no SGLang needed): one GPU is
enough. What one GPU cannot show: a peer blocked in a collective being released by the abort (NCCL refuses two ranks
on one GPU); that needs 2 GPUs and SGLang (tests/gpu/test_sglang_gpu.py).

- `warm_up` creates the NCCL communicator of a lazily made torch group (torch's `init_process_group` without
  `device_id`), and `measured` says what it took on the device;
- `abort` on a ProcessGroupNCCL goes through `_abort_process_group`, after which the group is unusable;
- the pynccl abort path (`ncclCommAbort` through ctypes, as on SGLang's `PyNcclCommunicator`) on a real 1-rank
  communicator of the NCCL library torch ships.
"""

from __future__ import annotations

import ctypes
import glob
import os
import socket
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from pat_rollout.comm import abort as comm_abort  # noqa: E402
from pat_rollout.comm import device_groups  # noqa: E402

pytestmark = pytest.mark.gpu


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def nccl_world():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)  # no device_id: groups are lazy, as in SGLang
    try:
        yield torch.device("cuda", 0)
    finally:
        dist.destroy_process_group()


def test_warm_up_makes_the_communicator_at_start_up(nccl_world):
    pg = dist.new_group([0], backend="nccl")
    out: dict = {}
    with device_groups.measured(nccl_world, out):
        assert device_groups.warm_up([pg], nccl_world) == 1
    first = out["bytes"]
    again: dict = {}
    with device_groups.measured(nccl_world, again):  # the communicator exists now: a second all-reduce adds none
        t = torch.ones(4, device=nccl_world)
        dist.all_reduce(t, group=pg)
    print(f"NCCL 1-rank communicator: {first} bytes at warm-up, {again['bytes']} bytes after")
    assert t.tolist() == [1.0] * 4
    assert first >= 0 and again["bytes"] <= first


def test_abort_a_process_group_nccl(nccl_world):
    pg = dist.new_group([0], backend="nccl")
    device_groups.warm_up([pg], nccl_world)
    co = SimpleNamespace(device_group=pg, pynccl_comm=None, ca_comm=None)
    assert comm_abort.abort(comm_abort.of_coordinator("tp1", co)) == ["tp1/process_group: aborted (ProcessGroupNCCL)"]
    with pytest.raises((RuntimeError, ValueError)):
        dist.all_reduce(torch.ones(1, device=nccl_world), group=pg)
        torch.cuda.synchronize()


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


def _libnccl() -> ctypes.CDLL:
    import torch.cuda.nccl  # noqa: F401 - loads the NCCL library torch links

    paths = [p for d in __import__("sys").path for p in glob.glob(os.path.join(d, "nvidia", "nccl", "lib",
                                                                                  "libnccl.so*"))]
    return ctypes.CDLL(paths[0] if paths else "libnccl.so.2")


def test_pynccl_abort_on_a_real_communicator():
    torch.cuda.set_device(0)
    lib = _libnccl()
    uid = _UniqueId()
    assert lib.ncclGetUniqueId(ctypes.byref(uid)) == 0
    comm = ctypes.c_void_p()
    lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, _UniqueId, ctypes.c_int]
    assert lib.ncclCommInitRank(ctypes.byref(comm), 1, uid, 0) == 0
    fake = SimpleNamespace(available=True, disabled=False, comm=comm, nccl=SimpleNamespace(lib=lib))
    assert comm_abort.abort([comm_abort.Communicator("pynccl", "tp1", fake)]) == ["tp1/pynccl: aborted (ncclCommAbort)"]
    assert fake.disabled
