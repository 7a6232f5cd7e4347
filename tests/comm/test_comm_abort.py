"""`comm.abort` and `comm.device_groups` without NCCL: fakes stand for the communicators (torch's NCCL abort and
`ncclCommAbort` are replaced by recorders), so what is checked is that an abort reaches every communicator of every
group handed in, in-graph ones first, that one failing abort does not hide the others, and that gloo groups are
left alone (real gloo: they stay usable)."""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from pat_rollout.comm import abort as comm_abort
from pat_rollout.comm import device_groups


class _FakeLib:
    def __init__(self, calls: list, rc: int = 0) -> None:
        self.calls, self.rc = calls, rc

    @property
    def ncclCommAbort(self):  # noqa: N802 - the C symbol's name
        calls, rc = self.calls, self.rc

        def fn(comm):
            calls.append(("ncclCommAbort", comm))
            return rc

        return fn


def _coordinator(name: str, calls: list, *, rc: int = 0, with_ca: bool = True, with_pynccl: bool = True):
    pynccl = SimpleNamespace(available=True, disabled=False, comm=f"comm-{name}",
                             nccl=SimpleNamespace(lib=_FakeLib(calls, rc))) if with_pynccl else None
    ca = SimpleNamespace(disabled=False) if with_ca else None
    return SimpleNamespace(device_group=f"pg-{name}", pynccl_comm=pynccl, ca_comm=ca)


@pytest.fixture
def nccl_fakes(monkeypatch):
    calls: list = []
    monkeypatch.setattr(comm_abort, "_backend", lambda pg: "nccl")
    monkeypatch.setattr(comm_abort, "_abort_process_group", lambda pg: calls.append(("pg_abort", pg)))
    return calls


def test_abort_reaches_every_communicator_of_every_group(nccl_fakes):
    calls = nccl_fakes
    coords = {"tp2": _coordinator("tp2", calls), "tp4": _coordinator("tp4", calls, with_ca=False)}
    comms = [c for name, co in coords.items() for c in comm_abort.of_coordinator(name, co)]
    assert sorted((c.name, c.kind) for c in comms) == [
        ("tp2", "custom_allreduce"), ("tp2", "process_group"), ("tp2", "pynccl"),
        ("tp4", "process_group"), ("tp4", "pynccl")]
    lines = comm_abort.abort(comms)
    # every pynccl communicator and every NCCL process group of both groups, in-graph ones before the groups
    assert calls == [("ncclCommAbort", "comm-tp2"), ("ncclCommAbort", "comm-tp4"), ("pg_abort", "pg-tp2"),
                     ("pg_abort", "pg-tp4")]
    assert coords["tp2"].pynccl_comm.disabled and coords["tp4"].pynccl_comm.disabled
    assert coords["tp2"].ca_comm.disabled
    assert lines == ["tp2/pynccl: aborted (ncclCommAbort)", "tp4/pynccl: aborted (ncclCommAbort)",
                     "tp2/custom_allreduce: disabled (no abort exists: a kernel spinning on a dead peer ends with the "
                     "process)", "tp2/process_group: aborted (ProcessGroupNCCL)",
                     "tp4/process_group: aborted (ProcessGroupNCCL)"]


def test_one_failing_abort_does_not_stop_the_others(nccl_fakes, monkeypatch):
    calls = nccl_fakes

    def broken(pg):
        raise RuntimeError("already destroyed")

    monkeypatch.setattr(comm_abort, "_abort_process_group", broken)
    coords = [("tp2", _coordinator("tp2", calls, rc=3)), ("tp4", _coordinator("tp4", calls))]
    lines = comm_abort.abort([c for n, co in coords for c in comm_abort.of_coordinator(n, co)])
    assert calls == [("ncclCommAbort", "comm-tp2"), ("ncclCommAbort", "comm-tp4")]
    assert "tp2/pynccl: ncclCommAbort returned 3" in lines
    assert lines.count("tp2/process_group: abort failed: RuntimeError: already destroyed") == 1
    assert lines.count("tp4/process_group: abort failed: RuntimeError: already destroyed") == 1


def test_uninitialised_pynccl_is_skipped(nccl_fakes):
    co = _coordinator("tp2", nccl_fakes, with_ca=False)
    co.pynccl_comm.available, co.pynccl_comm.disabled = False, True
    lines = comm_abort.abort(comm_abort.of_coordinator("tp2", co))
    assert nccl_fakes == [("pg_abort", "pg-tp2")]
    assert lines[0] == "tp2/pynccl: skipped (never initialised)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gloo_groups_are_left_usable_and_warm_up_skips_them():
    """A real (single-rank) gloo group: abort reports it skipped and it still runs collectives; warm_up makes no
    NCCL communicator for it; measured() reports 0 bytes off CUDA."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        pg = dist.new_group([0], backend="gloo")
        co = SimpleNamespace(device_group=pg, pynccl_comm=None, ca_comm=None)
        assert comm_abort.abort(comm_abort.of_coordinator("tp1", co)) == [
            "tp1/process_group: skipped (gloo: no abort in torch; its timeout bounds the wait)"]
        t = torch.ones(2)
        dist.all_reduce(t, group=pg)
        assert t.tolist() == [1.0, 1.0]
        out: dict = {}
        with device_groups.measured("cpu", out):
            assert device_groups.warm_up([pg, None], "cpu") == 0
        assert out == {"bytes": 0}
    finally:
        dist.destroy_process_group()
