"""Driver side of an SglPool's start-up, after the engine is up and the base weights are backed up: how much device
memory the layout communicators took, and the decode graphs of every candidate layout captured now, not inside a
switch the planner makes.

Capturing a layout's graphs needs that layout's module tree, KV view, attention backends and group
(`layout_graphs.enter`), i.e. the layout itself: `capture_all` enters each non-base layout once with an empty pool
(`SglPool.reconfigure`: a grow from TP1 moves no weight bytes, a shrink or a wider grow moves the weights the switch
would move anyway) and returns to the base. Only when graphs are on (a GPU with `disable_cuda_graph=False`, or the
recording capture of the CPU tests). A capture that fails rolls the pool back to the base layout (the switch's own
rollback); the start-up then fails with an error naming the layout and the ranks, after shutting the engine down.

`pending_capture_s(tp)`: the capture a switch into TP `tp` would still run (0 once captured; the planner adds it to
that switch's cost). With every layout captured here it is 0 for all; it says the longest start-up capture for a
layout that graphs are on for but that was not captured (none today).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


class GraphCaptureError(RuntimeError):
    """A candidate layout's decode graphs could not be captured at start-up."""


@dataclass(slots=True)
class PoolStartup:
    comm_bytes_per_gpu: int = 0  # the most any rank's layout communicators took (layout_comm)
    graphs_on: bool = False
    capture_s: dict[int, float] = field(default_factory=dict)  # TP -> seconds its start-up capture took (max rank)
    captured: set[int] = field(default_factory=set)  # TPs whose graphs exist on every rank

    def pending_capture_s(self, tp: int) -> float:
        if not self.graphs_on or tp in self.captured:
            return 0.0
        return max(self.capture_s.values(), default=0.0)

    def metrics(self) -> dict[str, float]:
        return {"pat/comm_bytes_per_gpu": float(self.comm_bytes_per_gpu),
                **{f"pat/startup_capture_tp{tp}_s": s for tp, s in sorted(self.capture_s.items())}}


def prepare(pool) -> PoolStartup:
    """Run right after `pat_backup_base` in `SglPool.__init__`: communicator report, then `capture_all`."""
    info = pool._rpc("pat_comm_info", path="")
    out = PoolStartup(comm_bytes_per_gpu=max(i["comm_bytes"] for i in info),
                      graphs_on=all(i["graphs"]["on"] for i in pool.info()))
    logger.info("SglPool: layout communicators take %.1f MiB per GPU at most (pat/comm_bytes_per_gpu; taken before "
                "the KV pool was sized); custom all-reduce per TP on rank 0: %s", out.comm_bytes_per_gpu / 2**20,
                info[0]["custom_ar"])
    if out.graphs_on:
        capture_all(pool, out)
    return out


def capture_all(pool, out: PoolStartup) -> None:
    from pat_rollout.driver.errors import ReconfigurationError

    base_tp = pool.base.tp_size
    out.captured.add(base_tp)  # SGLang's start-up capture, under the base layout's group
    for tp in sorted(pool.layouts):
        if tp == base_tp:
            continue
        try:
            res = pool.reconfigure(tp, {})
        except ReconfigurationError as e:  # rolled back: the pool is in its base layout
            pool.shutdown()
            raise GraphCaptureError(f"SglPool start-up: capturing the decode graphs of layout TP{tp} failed, the "
                                    f"pool was rolled back to its base layout {pool.base} and shut down; start with "
                                    f"TP{tp} out of candidate_tps, graphs off (disable_cuda_graph=True) or "
                                    f"layout_custom_all_reduce=False if memory is short: {e}") from e
        except BaseException:  # PoolBrokenError and the like: no known layout, nothing to keep
            pool.shutdown()
            raise
        out.capture_s[tp] = res.phase_s["capture"]
        out.captured.add(tp)
        try:
            pool.reconfigure(base_tp, {})
        except BaseException:
            pool.shutdown()
            raise
    logger.info("SglPool: decode graphs of TP %s captured at start-up in %s s", sorted(out.captured),
                {tp: round(s, 3) for tp, s in out.capture_s.items()})
