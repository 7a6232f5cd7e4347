"""Unit tests (no engine) of the pool's start-up capture wrapping and its device communicators (`layout_comm`):
- SGLang's start-up graph capture runs under the base layout's group, for initial_tp 1 and 2 on a 4-rank pool (the
  wrapping itself, with recording stand-ins for SGLang's methods: a 4-rank pool is too heavy here), and SGLang's own
  start-up reaches the capture method from a wrapped one (its source, on whichever version is installed);
- which communicators each layout's group gets (custom all-reduce off for non-base layouts by config);
- an abort request reaches every communicator of the named layout on a rank (the watcher thread), and "all" every
  layout's and the WORLD group's; an aborted layout is refused afterwards. Fakes stand for NCCL.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang.srt")

from pat_rollout.comm import abort as comm_abort  # noqa: E402
from pat_rollout.sglang import compat, layout_comm, pool_hooks  # noqa: E402
from pat_rollout.sglang.pool_startup import PoolStartup  # noqa: E402

pytestmark = pytest.mark.sglang


def _state(initial_tp: int, coords: dict) -> pool_hooks.PoolState:
    layouts = {tp: tuple(tuple(range(i, i + tp)) for i in range(0, 4, tp)) for tp in (1, 2, 4)}
    return pool_hooks.PoolState(rank=2, world=4, base=layouts[initial_tp], groups=layouts[initial_tp],
                                layouts=layouts, coordinators=coords)


@pytest.mark.parametrize("initial_tp", [1, 2])
def test_startup_capture_runs_under_the_base_group(initial_tp, monkeypatch):
    from sglang.srt.managers.tp_worker import TpModelWorker

    # the method holding SGLang's start-up capture is one of them (0.5.23: init_all_cuda_graphs, called by
    # init_model_worker itself; 0.5.12: ModelRunner.initialize calls init_device_graphs)
    cap_cls, cap_name = compat.startup_capture_method()
    names = [n for _, n in compat.build_methods()]
    if "init_all_cuda_graphs" in names:
        from sglang.srt.managers.scheduler import Scheduler

        assert "self.init_all_cuda_graphs()" in inspect.getsource(Scheduler.init_model_worker)
        assert "init_cuda_graphs(" in inspect.getsource(TpModelWorker.init_cuda_graphs)
        assert cap_name == "init_cuda_graphs"
    else:
        assert names == ["initialize"] and cap_name == "init_device_graphs"
        assert "self.init_device_graphs()" in inspect.getsource(cap_cls.initialize)

    coords = {1: SimpleNamespace(name="tp1"), 2: SimpleNamespace(name="tp2")}
    monkeypatch.setattr(pool_hooks, "STATE", _state(initial_tp, coords))
    current: list = []

    @contextlib.contextmanager
    def patch(group):
        current.append(group)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(compat, "tp_group_patch", patch)
    monkeypatch.setattr(pool_hooks, "_build_groups", lambda st: None)
    seen: dict[str, str] = {}
    methods = compat.build_methods()
    for cls, name in methods:  # recorders in place of SGLang's methods; monkeypatch restores the real ones
        monkeypatch.setattr(cls, name, lambda self, *a, _n=name, **kw: seen.__setitem__(
            _n, current[-1].name if current else "WORLD"))
    for cls, name in ((TpModelWorker, "forward_batch_generation"), compat.weight_update_method()):
        monkeypatch.setattr(cls, name, getattr(cls, name))
    pool_hooks._install_build_and_forward()
    for cls, name in methods:
        getattr(cls, name)(SimpleNamespace())
    assert seen == {name: f"tp{initial_tp}" for _, name in methods}


def test_comm_flags(monkeypatch):
    monkeypatch.setattr(layout_comm, "INFO", {"comm_bytes": 0, "warmed_groups": 0, "custom_ar": {}})
    monkeypatch.delenv(layout_comm.CUSTOM_AR_ENV, raising=False)
    assert layout_comm.comm_flags("gloo", 2, 1) == (False, False)
    assert layout_comm.comm_flags("nccl", 2, 1) == (None, None)  # SGLang's defaults: pynccl + custom AR
    monkeypatch.setenv(layout_comm.CUSTOM_AR_ENV, "0")
    assert layout_comm.comm_flags("nccl", 2, 1) == (None, False)  # non-base: no custom all-reduce
    assert layout_comm.comm_flags("nccl", 1, 1) == (None, None)  # the base keeps SGLang's
    assert layout_comm.INFO["custom_ar"] == {2: False, 1: True}
    assert layout_comm.engine_env(False) == {layout_comm.CUSTOM_AR_ENV: "0"}


def _fake_coordinator(name: str, calls: list):
    lib = SimpleNamespace(ncclCommAbort=lambda comm: calls.append(("ncclCommAbort", comm)) or 0)
    return SimpleNamespace(name=name, world_size=2, device_group=f"pg-{name}", ca_comm=SimpleNamespace(disabled=False),
                           pynccl_comm=SimpleNamespace(available=True, disabled=False, comm=f"comm-{name}",
                                                       nccl=SimpleNamespace(lib=lib)))


def _wait(pred, what: str) -> None:
    t = time.monotonic()
    while not pred():
        assert time.monotonic() - t < 20, what
        time.sleep(0.02)


def test_abort_request_reaches_every_communicator_of_the_layout(tmp_path, monkeypatch):
    from sglang.srt.distributed import parallel_state

    calls: list = []
    coords = {1: _fake_coordinator("tp1", calls), 2: _fake_coordinator("tp2", calls)}
    world_tp, world = _fake_coordinator("tp4", calls), _fake_coordinator("world", calls)
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: world_tp)
    monkeypatch.setattr(parallel_state, "get_world_group", lambda: world)
    monkeypatch.setattr(comm_abort, "_backend", lambda pg: "nccl")
    monkeypatch.setattr(comm_abort, "_abort_process_group", lambda pg: calls.append(("pg_abort", pg)))
    monkeypatch.setattr(layout_comm, "ABORTED", {})
    st = _state(1, coords)
    layout_comm.check_usable(2)
    assert layout_comm.start_watcher(st, str(tmp_path)).daemon

    layout_comm.request_abort(str(tmp_path), "rank 3 failed in the first entry of TP2", tp=2)
    _wait(lambda: "tp2" in layout_comm.ABORTED, "the watcher did not abort TP2's communicators")
    assert sorted(calls) == [("ncclCommAbort", "comm-tp2"), ("pg_abort", "pg-tp2")]
    assert coords[2].ca_comm.disabled and not coords[1].ca_comm.disabled
    with pytest.raises(RuntimeError, match="layout TP2: its device communicators were aborted"):
        layout_comm.check_usable(2)
    layout_comm.check_usable(1)  # the base still runs

    calls.clear()
    layout_comm.request_abort(str(tmp_path), "rank 3 died")
    _wait(lambda: "all" in layout_comm.ABORTED, "the watcher did not abort every communicator")
    assert sorted(calls) == sorted([(k, f"{p}-{n}") for n in ("tp1", "tp2", "tp4", "world")
                                    for k, p in (("ncclCommAbort", "comm"), ("pg_abort", "pg"))])
    for tp in (1, 4):
        with pytest.raises(RuntimeError, match=f"layout TP{tp}"):
            layout_comm.check_usable(tp)


def test_pending_capture_cost():
    s = PoolStartup(comm_bytes_per_gpu=3 << 20, graphs_on=True, capture_s={2: 4.0, 4: 6.0}, captured={1, 2})
    assert s.pending_capture_s(2) == 0.0 and s.pending_capture_s(1) == 0.0
    assert s.pending_capture_s(4) == 6.0  # not captured: the longest start-up capture
    assert PoolStartup(graphs_on=False).pending_capture_s(4) == 0.0
    assert s.metrics() == {"pat/comm_bytes_per_gpu": float(3 << 20), "pat/startup_capture_tp2_s": 4.0,
                           "pat/startup_capture_tp4_s": 6.0}
