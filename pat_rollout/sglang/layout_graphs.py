"""Decode graphs per layout: each layout keeps the attention backends and the decode graph runner captured under it.

A captured CUDA graph replays its kernels on the addresses, shapes and attention-backend buffers it was captured
with. The pool already keeps every parameter at its address in every layout (`reshard_local(keep_storage=True)`),
views the same KV storage per layout (`kv_room`) and reuses the module tree built for a layout (`pool_switch.
_rebuild`). Here a layout's attention backends and decode graph runner are kept too: entering a layout for the first
time builds its attention backends and captures its decode graphs under its group (the switch phase "capture"),
entering it again restores both, so every layout replays its own graphs. SGLang captures the base layout's at
start-up, under the base layout's group (`compat.build_methods` wraps the start-up capture on both versions); the
pool keeps those at the first switch. The driver then enters every other candidate layout once at start-up
(`pool_startup.capture_all`), so no capture is left for a switch the planner makes.

A rank that fails in a switch whose layout was not captured yet may leave a peer inside the capture's warm-up
collectives (pynccl: no timeout): `on_switch_failure` asks every rank to abort that layout's communicators
(`layout_comm`), which releases the peer; the layout is refused from then on.

Graphs run only when the server has them on (`engine_args={"disable_cuda_graph": False}`, a GPU); otherwise a
switch only rebuilds the attention backends, as before. Untested on a GPU (none here). On CPU the selection is
tested with a recording capture: `PAT_SGLANG_FAKE_GRAPHS=1` in the environment the schedulers start with
(`FakeGraphRunner`: records the group, model and backend it was captured with, never runs).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from pat_rollout.sglang import compat, pool_hooks

logger = logging.getLogger(__name__)

FAKE_GRAPHS_ENV = "PAT_SGLANG_FAKE_GRAPHS"
FAKE_FAIL_ENV = "PAT_SGLANG_FAKE_GRAPHS_FAIL"  # tests: "tp:rank": that rank's recording capture of TP tp raises


@dataclass(slots=True)
class LayoutGraphs:
    attention: dict[str, Any]  # the model runner's attention backend attributes (compat.attention_state)
    runner: Any  # its decode graph runner (None where SGLang captured none)


@dataclass(slots=True)
class FakeGraphRunner:
    """Tests on CPU: what a capture saw. Never replays (`can_run*` False), so forwards stay eager."""

    tp: int
    model_id: int
    attention_id: int
    param_ptr: int

    def can_run(self, *_: Any, **__: Any) -> bool:  # 0.5.12
        return False

    def can_run_graph(self, *_: Any, **__: Any) -> bool:  # 0.5.23
        return False


def enabled(scheduler) -> bool:
    return not scheduler.server_args.disable_cuda_graph or os.environ.get(FAKE_GRAPHS_ENV) == "1"


def install() -> None:
    """Pool ranks, with the recording capture only: SGLang's start-up capture method also records a FakeGraphRunner
    with the group, model and backend in effect, i.e. what the real capture's collectives would have used."""
    if os.environ.get(FAKE_GRAPHS_ENV) != "1":
        return
    cls, name = compat.startup_capture_method()
    orig = getattr(cls, name)

    def capture(self, *a: Any, **kw: Any) -> Any:
        out = orig(self, *a, **kw)
        compat.set_graph_runner(self, _fake_capture(self))
        return out

    setattr(cls, name, capture)


def on_switch_failure(scheduler, phase: str, dst_tp: int) -> None:
    """This rank's switch to TP `dst_tp` failed in `phase`. If that layout's graphs were not captured yet, a peer may
    be inside the capture's collectives: abort the layout's communicators on every rank (`layout_comm`)."""
    st = pool_hooks.STATE
    if phase != "switch" or not enabled(scheduler) or dst_tp in st.graphs or dst_tp == len(st.base[0]):
        return
    from pat_rollout.sglang import layout_comm

    try:  # never hides the switch's own error
        workdir = json_cfg().get("stack_dir", "")
        layout_comm.request_abort(workdir, f"rank {st.rank} failed in the first entry (capture) of TP{dst_tp}",
                                  dst_tp)
        layout_comm.abort_local(st, f"tp{dst_tp}")
    except Exception:
        logger.exception("rank %d: aborting the communicators of TP%d failed", st.rank, dst_tp)


def json_cfg() -> dict[str, Any]:
    import json

    raw = os.environ.get(pool_hooks.POOL_ENV)
    return json.loads(raw) if raw else {}


def remember(scheduler, tp: int) -> None:
    """Keep the current layout's backends and graphs (SGLang's start-up ones) before the first switch leaves it."""
    st, runner = pool_hooks.STATE, scheduler.tp_worker.model_runner
    if enabled(scheduler) and tp not in st.graphs:
        st.graphs[tp] = LayoutGraphs(compat.attention_state(runner), compat.graph_runner(runner))


def enter(scheduler, tp: int) -> float:
    """Make layout `tp`'s attention backends and decode graphs current (the module tree and KV room already are);
    returns the seconds spent capturing (0 when reused or graphs are off)."""
    from pat_rollout.sglang import layout_comm

    layout_comm.check_usable(tp)
    st, runner = pool_hooks.STATE, scheduler.tp_worker.model_runner
    if not enabled(scheduler):
        with pool_hooks.tp_context():  # backends size per-head state from the layout at build time
            compat.reinit_attention(scheduler.tp_worker)
        return 0.0
    kept = st.graphs.get(tp)
    if kept is not None:
        compat.set_attention_state(runner, kept.attention)
        compat.set_graph_runner(runner, kept.runner)
        return 0.0
    t = time.perf_counter()
    with pool_hooks.tp_context():  # captured under the layout's group: its collectives are what replays
        compat.reinit_attention(scheduler.tp_worker)
        graphs = _fake_capture(runner) if os.environ.get(FAKE_GRAPHS_ENV) == "1" else compat.capture_decode_graphs(runner)
    compat.set_graph_runner(runner, graphs)
    st.graphs[tp] = LayoutGraphs(compat.attention_state(runner), graphs)
    return time.perf_counter() - t


def describe(runner_obj: Any) -> dict[str, Any]:
    """For `pat_pool_info`: which graph runner object is current (a fake one says what it was captured with)."""
    out: dict[str, Any] = dict(id=id(runner_obj), type=type(runner_obj).__name__)
    if isinstance(runner_obj, FakeGraphRunner):
        out.update(tp=runner_obj.tp, model_id=runner_obj.model_id, attention_id=runner_obj.attention_id,
                   param_ptr=runner_obj.param_ptr)
    return out


def _fake_capture(runner) -> FakeGraphRunner:
    from sglang.srt.distributed.parallel_state import get_tp_group

    tp = get_tp_group().world_size
    if os.environ.get(FAKE_FAIL_ENV) == f"{tp}:{pool_hooks.STATE.rank}":
        raise RuntimeError(f"injected capture failure of TP{tp} on rank {pool_hooks.STATE.rank}")
    return FakeGraphRunner(tp=tp, model_id=id(runner.model), attention_id=id(runner.attn_backend),
                           param_ptr=next(runner.model.parameters()).data_ptr())
