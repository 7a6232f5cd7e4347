"""The driver's background loop: the one thread that drives the pool while requests run (dispatch, steps, layout
switches; calls that need an idle pool, such as weight updates, wait for it). Top to bottom as `_loop` runs it:

    wait for work (requests, a caller's switch or moves, an abort, shutdown)
    -> abort? every request ends with its partial output                                  _do_abort
    -> a caller's reconfigure(tp) / rebalance(moves)                                      _manual_*
    -> a batch reaching an idle pool starts a stage: base layout, or the planner's pick   _start_stage
    -> dispatch new requests, each to the replica with the fewest in flight               _dispatch
    -> poll: step every busy replica k times -> resolve finished futures                  _poll
       -> planner: snapshot -> decide -> pool.reconfigure / pool.rebalance                switching.py
    -> nothing left in flight: the stage ends                                             _end_stage

An error in any of it fails every request in flight, and marks the pool broken when a device is gone (_fail_all).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from typing import TYPE_CHECKING

from pat_rollout.driver.errors import PoolBrokenError, ReconfigurationError, WorkerError
from pat_rollout.driver.metrics import StageMetrics
from pat_rollout.driver.planner_glue import prompt_key
from pat_rollout.driver.switching import Switching
from pat_rollout.planner.balance import assign_new
from pat_rollout.types import Request, RequestOutput

if TYPE_CHECKING:
    from pat_rollout.config import PatRolloutConfig
    from pat_rollout.driver.pool import Pool
    from pat_rollout.layout import Layout
    from pat_rollout.planner import Planner
    from pat_rollout.types import ModelSpec

logger = logging.getLogger(__name__)


class DriverLoop(Switching):
    """The loop's thread and what callers hand it (new requests, manual switches, aborts) under one lock.
    The base of `api.RolloutDriver`, which starts the thread once the driver is built."""

    def __init__(self, config: PatRolloutConfig, spec: ModelSpec, base: Layout, pool: Pool,
                 planner: Planner | None) -> None:
        super().__init__(config, spec, base, pool, planner)
        self._lock = threading.Condition()
        self._inbox: list[tuple[Request, cf.Future]] = []
        self._futures: dict[str, cf.Future] = {}  # request id -> its future, every dispatched request
        self._last_stage: StageMetrics | None = None
        self._manual_tp: int | None = None  # a pending reconfigure(tp) call
        self._manual_err: Exception | None = None
        self._manual_moves: dict[str, int] | None = None  # a pending rebalance(moves) call
        self._abort = False
        self._aborted: list[RequestOutput] = []
        self._stop = False
        self._broken: str | None = None  # why the pool cannot serve any more
        self._thread = threading.Thread(target=self._loop, name="pat-driver", daemon=True)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._inbox or self._futures or self._stop or self._manual_tp
                           or self._abort or self._manual_moves is not None):
                    self._lock.wait()
                if self._stop:
                    return
                new, self._inbox = self._inbox, []
            try:
                if self._abort:
                    self._do_abort(new)
                    continue
                if self._manual_tp:
                    self._manual_reconfigure()
                if self._manual_moves is not None:
                    self._manual_rebalance()
                if new and not self._futures:
                    self._start_stage([req for req, _ in new])
                self._dispatch(new)
                new = []
                if self._futures:
                    self._poll()
                if not self._futures and self._stage is not None:
                    self._end_stage()
            except Exception as e:  # a dead actor or a bug: fail every in-flight request loudly
                logger.exception("PAT driver loop failed")
                for req, fut in new:  # taken from the inbox but never dispatched
                    self._futures.setdefault(req.request_id, fut)
                self._fail_all(e)

    # ---- stages ----------------------------------------------------------------------------------------------
    def _start_stage(self, batch: list[Request]) -> None:
        self._stage = StageMetrics()
        if self.layout != self.base and (self.planner is None or not self.planner.config.start_layout):
            self._to_base()  # unless the planner picks the starting layout, a stage starts in the base layout
        self._stage.record_layout(str(self.layout), self.pool.kv_tokens)
        if self.planner is not None:
            self.planner.start_stage()
            self._start_layout(batch)  # the planner picks the layout; nothing is dispatched yet, so nothing to hand off

    def _end_stage(self) -> None:
        if self._stage is None:
            return
        if self.planner is not None:
            self._stage.planner = self.planner.stage_metrics()
        self._stage.finish()
        self._last_stage, self._stage = self._stage, None
        logger.info("stage done: %s", {k: v for k, v in self._last_stage.as_dict().items()})

    # ---- requests in, outputs out ----------------------------------------------------------------------------
    def _dispatch(self, new: list[tuple[Request, cf.Future]]) -> None:
        if not new:
            return
        load = [0] * self.layout.num_replicas
        for r in self._assignment.values():
            load[r] += 1
        per_replica: dict[int, list[Request]] = {}
        for (req, fut), r in zip(new, assign_new(load, [1] * len(new))):  # least-inflight, as verl's balancer
            per_replica.setdefault(r, []).append(req)
            self._assignment[req.request_id] = r
            self._futures[req.request_id] = fut
            self._requests[req.request_id] = req
            self._prompt_keys[req.request_id] = prompt_key(req.prompt_token_ids)
        self.pool.add_requests(per_replica)

    def _poll(self) -> None:
        busy = sorted({r for r in self._assignment.values()})
        t0 = time.perf_counter()
        results = self.pool.step(busy, self.config.steps_per_poll)
        self._record_poll(results, time.perf_counter() - t0)
        self._num_polls += 1
        self._stage.num_polls += 1
        done = []
        self._snapshots = {r: snap for r, (_, snap) in results.items()}  # the planner's view of each replica
        for r in busy:
            step, snap = results[r]
            self._stage.record_step(r, step)
            done.extend(self._finish(out) for out in step.finished)
            for info in snap.running:
                self._progress[info.request_id] = info
        if not self._futures:
            self._end_stage()  # before waking callers, so stage_metrics() sees this stage
        self._resolve(done)
        if self.planner is not None and self._futures:
            self._maybe_reconfigure()

    def _finish(self, out: RequestOutput) -> tuple[cf.Future | None, RequestOutput]:
        """Bookkeeping for a finished request; returns its future for `_resolve`."""
        rid = out.request_id
        self._assignment.pop(rid, None)
        self._progress.pop(rid, None)
        req = self._requests.pop(rid, None)
        key = self._prompt_keys.pop(rid, None)
        fut = self._futures.pop(rid, None)
        if self._stage is not None:
            self._stage.response_lengths.append(len(out.token_ids))
        if self.planner is not None and req is not None:
            self.planner.observe_finished(key, len(out.token_ids))
        return fut, out

    @staticmethod
    def _resolve(done: list[tuple[cf.Future | None, RequestOutput]]) -> None:
        for fut, out in done:
            if fut is not None and not fut.done():
                fut.set_result(out)

    # ---- what callers hand the loop --------------------------------------------------------------------------
    def _manual_reconfigure(self) -> None:
        tp = self._manual_tp
        err = None
        try:
            if tp == self.layout.tp_size:
                return
            if self._stage is None:
                self._stage = StageMetrics()
            self._apply_reconfigure(tp)
        except ReconfigurationError as e:  # rolled back, every request kept
            err = e
        except Exception as e:  # requests may be lost: fail them all (and maybe mark the pool broken)
            err = e
            self._fail_all(e)
        finally:
            with self._lock:
                self._manual_err = err
                self._manual_tp = None

    def _manual_rebalance(self) -> None:
        err = None
        try:
            moves = {rid: r for rid, r in self._manual_moves.items() if self._assignment.get(rid, r) != r}
            if moves:
                if self._stage is None:
                    self._stage = StageMetrics()
                self._apply_rebalance(moves)
        except Exception as e:
            err = e
        finally:
            with self._lock:
                self._manual_err = err
                self._manual_moves = None

    def _do_abort(self, new: list[tuple[Request, cf.Future]]) -> None:
        outs = []
        if self._futures:
            outs.extend(self.pool.abort_all())
        done = [self._finish(out) for out in outs]
        if self._stage is not None and not self._futures:
            self._end_stage()
        self._resolve(done)
        for req, fut in new:
            out = RequestOutput(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, token_ids=(),
                                log_probs=(), finish_reason="abort")
            fut.set_result(out)
            outs.append(out)
        self._aborted = outs
        with self._lock:
            self._abort = False

    # ---- failure ---------------------------------------------------------------------------------------------
    def _fail_all(self, error: Exception) -> None:
        """Fail every request in flight with `error`, then abort the engines' copies so the same ids can be
        resubmitted; if the devices cannot even do that, mark the pool broken."""
        pending = sorted(self._futures)
        msg = f"PAT rollout failed with {len(pending)} requests in flight ({pending[:8]}...): {error}"
        if isinstance(error, WorkerError):
            msg += f"; dead/failed devices: {list(error.devices)}"
        if isinstance(error, PoolBrokenError) or (isinstance(error, WorkerError) and error.unresponsive):
            self._broken = str(error)
        elif pending:
            try:
                self.pool.abort_all()
            except Exception as e:
                logger.exception("aborting the failed requests in the engines failed")
                self._broken = f"{error}; then aborting the failed requests failed: {e}"
        if self._broken is not None:
            msg += "; the pool is broken and refuses new requests"
        for rid in pending:
            fut = self._futures.pop(rid)
            if not fut.done():
                fut.set_exception(PoolBrokenError(msg) if self._broken is not None else RuntimeError(msg))
        self._assignment.clear()
        self._progress.clear()
        self._requests.clear()
        self._prompt_keys.clear()
        if self._stage is not None:
            self._end_stage()
