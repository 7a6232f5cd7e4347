"""Decode graphs per layout: each layout keeps the attention backends and the decode graph runner captured under it.

A captured CUDA graph replays its kernels on the addresses, shapes and attention-backend buffers it was captured
with. The pool already keeps every parameter at its address in every layout (`reshard_local(keep_storage=True)`),
views the same KV storage per layout (`kv_room`) and reuses the module tree built for a layout (`pool_switch.
_rebuild`). Here a layout's attention backends and decode graph runner are kept too: entering a layout for the first
time builds its attention backends and captures its decode graphs under its group (the switch phase "capture"),
entering it again restores both, so every layout replays its own graphs. SGLang captures the base layout's at
start-up; the pool keeps those at the first switch.

Graphs run only when the server has them on (`engine_args={"disable_cuda_graph": False}`, a GPU); otherwise a
switch only rebuilds the attention backends, as before. Untested on a GPU (none here). On CPU the selection is
tested with a recording capture: `PAT_SGLANG_FAKE_GRAPHS=1` in the environment the schedulers start with
(`FakeGraphRunner`: records the group, model and backend it was captured with, never runs).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from pat_rollout.sglang import compat, pool_hooks

FAKE_GRAPHS_ENV = "PAT_SGLANG_FAKE_GRAPHS"


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


def remember(scheduler, tp: int) -> None:
    """Keep the current layout's backends and graphs (SGLang's start-up ones) before the first switch leaves it."""
    st, runner = pool_hooks.STATE, scheduler.tp_worker.model_runner
    if enabled(scheduler) and tp not in st.graphs:
        st.graphs[tp] = LayoutGraphs(compat.attention_state(runner), compat.graph_runner(runner))


def enter(scheduler, tp: int) -> float:
    """Make layout `tp`'s attention backends and decode graphs current (the module tree and KV room already are);
    returns the seconds spent capturing (0 when reused or graphs are off)."""
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

    return FakeGraphRunner(tp=get_tp_group().world_size, model_id=id(runner.model), attention_id=id(runner.attn_backend),
                           param_ptr=next(runner.model.parameters()).data_ptr())
