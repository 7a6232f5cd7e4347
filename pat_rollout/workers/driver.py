"""The driver: owns a pool of devices (reference-engine shard actors or SGLang ranks), schedules
requests onto DP replicas, runs the generation loop in a background thread and lets the planner
reconfigure TP while it runs.

    loop: dispatch new requests -> step every busy replica k times -> resolve finished futures
          -> every poll: snapshot -> planner.decide -> pool.reconfigure
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from pat_rollout.config import DTYPE_BYTES, PatRolloutConfig
from pat_rollout.driver.planner_glue import (
    build_planner,
    cluster_state,
    load_profile,
    poll_sample,
    prompt_key,
    start_state,
)
from pat_rollout.engine.base import RunningInfo
from pat_rollout.engine.ref.config import RefEngineConfig, check_request
from pat_rollout.kv.cost import handoff_cost
from pat_rollout.layout import Layout, model_shard_specs
from pat_rollout.planner.balance import assign_new
from pat_rollout.planner.calibration import ReconfigSample
from pat_rollout.planner.state import Decision
from pat_rollout.types import Request, RequestOutput
from pat_rollout.workers.errors import PoolBrokenError, WorkerError
from pat_rollout.workers.metrics import StageMetrics
from pat_rollout.workers.pool import Pool, RefPool
from pat_rollout.workers.reconfigure import ReconfigurationError, Reconfigurer

logger = logging.getLogger(__name__)


class RolloutDriver:
    """A PAT rollout pool of `config.num_devices` devices. Thread-safe `submit`; blocking `generate`.

    Reliability: every RPC has a deadline (config.rpc_deadline_s), every request's future resolves (a
    result, or an error naming the phase and devices), a pool that cannot serve any more is marked broken
    and every call then raises at once, and after `shutdown()` every call raises at once."""

    def __init__(self, config: PatRolloutConfig, *, num_cpus_per_worker: float = 1) -> None:
        self.config = config
        config.planner_config()  # unknown planner options fail under every policy, before any actor starts
        self.base = Layout.uniform(config.num_devices, config.initial_tp)
        if config.backend == "reference":
            # The engine's own config validates the checkpoint, so the pool fails before starting any actor.
            self.engine_config = RefEngineConfig(
                model_path=config.model_path, dtype=config.dtype, max_tp=config.max_tp, block_size=config.block_size,
                num_kv_blocks=config.num_kv_blocks, max_num_seqs=config.max_num_seqs)
            self.spec = self.engine_config.model_spec()
            for tp in config.tp_sizes:
                self.engine_config.check_tp(self.spec, tp)
        else:
            from pat_rollout.sglang.pool import check_model

            self.engine_config = None
            self.spec = check_model(config)
        needs_profile = config.policy == "pat" or (config.kv_handoff == "auto" and len(config.tp_sizes) > 1)
        self.profile = load_profile(config) if needs_profile else None
        self.planner = build_planner(config, self.spec, self.profile) if config.policy == "pat" else None
        cost = handoff_cost(self.profile) if self.profile else None
        if config.backend == "reference":
            from pat_rollout.workers.group import WorkerGroup  # Ray: only the reference backend's actors need it

            group = WorkerGroup(num_cpus_per_worker=num_cpus_per_worker, world_size=config.num_devices,
                                engine=self.engine_config, initial_layout=self.base, tp_sizes=config.tp_sizes,
                                comm_timeout_s=config.comm_timeout_s, default_timeout_s=config.rpc_deadline_s())
            reconfigurer = Reconfigurer(group, self.spec, model_shard_specs(self.spec, config.max_tp), self.base,
                                        handoff=config.kv_handoff, cost=cost, dtype_bytes=DTYPE_BYTES[config.dtype],
                                        deadline=config.rpc_deadline_s)
            self.pool: Pool = RefPool(group, reconfigurer, self.base, deadline=config.rpc_deadline_s,
                                      max_num_seqs=config.max_num_seqs,
                                      kv_capacity_tokens=config.num_kv_blocks * config.block_size)
        else:
            from pat_rollout.sglang.pool import SglPool

            self.pool = SglPool(config, self.spec, self.base, cost=cost)
        if self.planner is not None:
            self.planner.can_rebalance = self.pool.supports_rebalance
        self._lock = threading.Condition()
        self._inbox: list[tuple[Request, cf.Future]] = []
        self._futures: dict[str, cf.Future] = {}
        self._requests: dict[str, Request] = {}
        self._prompt_keys: dict[str, str] = {}  # request id -> prompt_key, hashed once at dispatch
        self._assignment: dict[str, int] = {}
        self._progress: dict[str, RunningInfo] = {}
        self._stage: StageMetrics | None = None
        self._last_stage: StageMetrics | None = None
        self._num_polls = 0
        self._manual_tp: int | None = None  # a pending reconfigure(tp) call
        self._manual_err: Exception | None = None
        self._manual_moves: dict[str, int] | None = None  # a pending rebalance(moves) call
        self._abort = False
        self._aborted: list[RequestOutput] = []
        self.last_reconfig = None  # ReconfigResult of the latest switch
        self.samples: deque = deque(maxlen=4096)  # PollSample / ReconfigSample the planner calibrated from, newest last
        self._stop = False
        self._broken: str | None = None  # why the pool cannot serve any more
        self._released: set[str] = set()  # release() tags not resumed yet
        self._thread = threading.Thread(target=self._loop, name="pat-driver", daemon=True)
        self._thread.start()

    # ---- public API -------------------------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        return self.pool.layout

    @property
    def assignment(self) -> dict[str, int]:
        """A copy of request id -> replica of every unfinished request."""
        return dict(self._assignment)

    def submit(self, request: Request) -> cf.Future:
        """Queue `request`; the future resolves to its RequestOutput. Requests that can never run
        (too long, token ids outside the vocab, more KV than a device holds) raise ValueError here."""
        return self.submit_many([request])[0]

    def submit_many(self, requests: Iterable[Request]) -> list[cf.Future]:
        """Queue a batch atomically: every request is validated (including duplicate ids in the batch
        and against requests in flight) before any starts, so a bad one rejects the whole batch."""
        requests = list(requests)
        self._check_usable()
        if "kv_cache" in self._released:
            raise RuntimeError("the KV cache is released; call resume(['kv_cache']) before submitting requests")
        for request in requests:
            if self.engine_config is not None:
                check_request(request.request_id, request.prompt_token_ids, request.sampling.max_new_tokens,
                              self.spec, self.engine_config)
            else:
                self.pool.check_request(request)
        ids = [r.request_id for r in requests]
        if repeated := sorted({i for i in ids if ids.count(i) > 1}):
            raise ValueError(f"request_id(s) {repeated} repeated in one batch; nothing was submitted")
        futures = [cf.Future() for _ in requests]
        with self._lock:
            self._check_usable()
            live = set(self._futures) | {r.request_id for r, _ in self._inbox}
            if busy := sorted(set(ids) & live):
                raise ValueError(f"request_id(s) {busy} already in flight; nothing was submitted")
            self._inbox.extend(zip(requests, futures))
            self._lock.notify_all()
        return futures

    def generate(self, requests: Iterable[Request], timeout: float | None = None) -> list[RequestOutput]:
        """Run a batch to completion (validated whole first, see `submit_many`)."""
        return [f.result(timeout=timeout) for f in self.submit_many(requests)]

    def reconfigure(self, tp: int) -> None:
        """Switch layout now (between polls). Mostly for tests and demos; the planner calls it itself."""
        if tp not in self.config.tp_sizes:
            raise ValueError(f"tp={tp} is not one of this pool's TP sizes {self.config.tp_sizes} "
                             f"(policy={self.config.policy!r}); their groups are built at start-up")
        with self._lock:
            self._check_usable()
            self._manual_tp = tp
            self._lock.notify_all()
        while True:
            with self._lock:
                if self._manual_tp is None:
                    err = self._manual_err
                    self._manual_err = None
                    break
                if self._stop or not self._thread.is_alive():
                    self._manual_tp = None
                    raise RuntimeError("RolloutDriver was shut down while reconfigure() waited")
            time.sleep(0.005)
        if err is not None:
            raise err

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Load new full weights on every device; the pool returns to its base layout first."""
        self._wait_idle()
        with self._guard():
            self._to_base()
            self.pool.update_weights(list(named_tensors))

    def release(self, tags: Iterable[str] = ("weights", "kv_cache")) -> None:
        tags = list(tags)
        self._wait_idle()
        with self._guard():
            self.pool.release(tags)
        self._released |= set(tags)

    def resume(self, tags: Iterable[str] = ("weights", "kv_cache")) -> None:
        tags = list(tags)
        self._check_usable()
        with self._guard():
            self.pool.resume(tags)
        self._released -= set(tags)

    def abort_all(self) -> list[RequestOutput]:
        self._check_usable()
        with self._lock:
            self._abort = True
            self._lock.notify_all()
        self._wait_idle()
        return self._aborted

    def stage_metrics(self) -> dict[str, Any]:
        stage = self._last_stage or self._stage
        return stage.as_dict() if stage else {}

    def worker_info(self) -> list[dict[str, Any]]:
        self._check_usable()
        return self.pool.info()

    @property
    def broken(self) -> str | None:
        """Why the pool cannot serve any more, or None while it can."""
        return self._broken

    def shutdown(self) -> None:
        """Stop the loop, fail every request still in flight and stop the devices. Idempotent."""
        with self._lock:
            if self._stop:
                return
            self._stop = True
            self._lock.notify_all()
        self._thread.join(timeout=self.config.rpc_deadline_s())  # it finishes at most the RPC in progress
        with self._lock:
            pending = [fut for _, fut in self._inbox] + list(self._futures.values())
            self._inbox.clear()
            self._futures.clear()
        error = RuntimeError(f"RolloutDriver was shut down with {len(pending)} requests in flight")
        for fut in pending:
            if not fut.done():
                fut.set_exception(error)
        self.pool.shutdown()

    # ---- background loop --------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._stop:
            raise RuntimeError("RolloutDriver is shut down")
        if self._broken is not None:
            raise PoolBrokenError(f"the PAT rollout pool is broken: {self._broken}")

    @contextlib.contextmanager
    def _guard(self):
        """Mark the pool broken when a call made outside the loop (weights, release) finds it unusable."""
        self._check_usable()
        try:
            yield
        except (PoolBrokenError, WorkerError) as e:
            if isinstance(e, PoolBrokenError) or e.unresponsive:
                self._broken = str(e)
            raise

    def _wait_idle(self) -> None:
        while True:
            with self._lock:
                self._check_usable()
                if not self._inbox and not self._futures and not self._abort:
                    return
            time.sleep(0.01)

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

    def _start_stage(self, batch: list[Request]) -> None:
        self._stage = StageMetrics()
        if self.layout != self.base and (self.planner is None or not self.planner.config.start_layout):
            self._to_base()  # unless the planner picks the starting layout, a stage starts in the base layout
        self._stage.record_layout(str(self.layout))
        if self.planner is not None:
            self.planner.start_stage()
            self._start_layout(batch)  # the planner picks the layout; nothing is dispatched yet, so nothing to hand off

    def _start_layout(self, batch: list[Request]) -> None:
        # Measurements are valid for this model on this pool's layouts; the planner forgets them otherwise.
        self.planner.calibration.bind((self.spec, self.config.num_devices, self.config.tp_sizes))
        keys = {r.request_id: prompt_key(r.prompt_token_ids) for r in batch}
        step = self._num_polls * self.config.steps_per_poll
        decision = self.planner.choose_start(start_state(step, self.config.num_devices, self.layout.tp_size, batch,
                                                         keys))
        if decision is None:
            return
        logger.info("planner: %s -> TP%d (%s)", self.layout, decision.target_tp, decision.reason)
        try:
            self._apply_reconfigure(decision.target_tp)
        except ReconfigurationError as e:  # rolled back to the base layout: start there
            self.planner.cancel(decision)
            logger.error("%s", e)

    def _end_stage(self) -> None:
        if self._stage is None:
            return
        if self.planner is not None:
            self._stage.planner = self.planner.stage_metrics()
        self._stage.finish()
        self._last_stage, self._stage = self._stage, None
        logger.info("stage done: %s", {k: v for k, v in self._last_stage.as_dict().items()})

    def _to_base(self) -> None:
        if self.layout != self.base:
            self.pool.reconfigure(self.base.tp_size, self._assignment)

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
        for r in busy:
            step, snap = results[r]
            self._stage.num_decode_tokens += step.num_decode_tokens
            self._stage.num_prefill_tokens += step.num_prefill_tokens
            if step.finished:
                self._stage.record_replica_finish(r)
            done.extend(self._finish(out) for out in step.finished)
            for info in snap.running:
                self._progress[info.request_id] = info
        if not self._futures:
            self._end_stage()  # before waking callers, so stage_metrics() sees this stage
        self._resolve(done)
        if self.planner is not None and self._futures:
            self._maybe_reconfigure()

    def _record_poll(self, results: dict, elapsed_s: float) -> None:
        """Feed the planner's calibration what this poll measured (polls that also prefilled are left out)."""
        sample = poll_sample(self.layout.tp_size, results, elapsed_s) if self.planner is not None else None
        if sample is not None:
            self.samples.append(sample)
            self.planner.observe_poll(sample)

    def _record_reconfig(self, src_tp: int, num_tokens: tuple[int, ...], elapsed_s: float) -> None:
        if self.planner is None or src_tp == self.layout.tp_size:
            return
        sample = ReconfigSample(num_devices=self.config.num_devices, tp_src=src_tp, tp_dst=self.layout.tp_size,
                                num_tokens=num_tokens, elapsed_s=elapsed_s)
        self.samples.append(sample)
        self.planner.observe_reconfig(sample)

    @staticmethod
    def _resolve(done: list[tuple[cf.Future | None, RequestOutput]]) -> None:
        for fut, out in done:
            if fut is not None and not fut.done():
                fut.set_result(out)

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

    def _maybe_reconfigure(self) -> None:
        state = cluster_state(self._num_polls * self.config.steps_per_poll, self.config.num_devices,
                              self.layout.tp_size, self._requests, self._progress, self._prompt_keys,
                              self._assignment)
        decision = self.planner.decide(state)
        if decision is not None and decision.is_rebalance:
            self._planned_rebalance(decision)
            return
        if decision is None or decision.target_tp == self.layout.tp_size:
            return
        logger.info("planner: %s -> TP%d (%s)", self.layout, decision.target_tp, decision.reason)
        try:
            self._apply_reconfigure(decision.target_tp)
        except ReconfigurationError as e:  # rolled back, requests kept: keep generating
            logger.error("%s", e)
            self.planner.cancel(decision)  # hysteresis and the per-stage cap count only switches that happened

    def _apply_reconfigure(self, tp: int) -> None:
        src_tp = self.layout.tp_size
        num_tokens = tuple(i.num_prompt_tokens + i.num_output_tokens for rid, i in self._progress.items()
                           if rid in self._assignment)
        t0 = time.perf_counter()
        try:
            result = self.pool.reconfigure(tp, self._assignment)
        except ReconfigurationError as e:
            self._stage.num_failed_reconfigs += 1
            self._assignment = dict(e.assignment)
            self._stage.record_layout(str(self.layout))
            raise
        self.last_reconfig = result
        self._record_reconfig(src_tp, num_tokens, time.perf_counter() - t0)
        self._assignment = {rid: result.assignment[rid] for rid in self._assignment}
        self._stage.num_reconfigs += 1
        self._stage.num_migrated += len(result.migrated)
        self._stage.num_recomputed += len(result.recomputed)
        self._stage.num_import_fallbacks += len(result.import_fallbacks)
        self._stage.kv_bytes_received += result.kv_bytes_received
        for phase, s in result.phase_s.items():
            self._stage.add_phase(phase, s)
        self._stage.last_switch_s = time.perf_counter()
        self._stage.record_layout(str(self.layout))

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

    # ---- rebalance (workers/rebalance.py): move requests between replicas of the current layout ----------
    def rebalance(self, moves: dict[str, int]) -> None:
        """Move unfinished requests to other replicas now (request id -> replica; requests that finished or
        already sit there are skipped). Mostly for tests and demos; the planner decides it itself."""
        if not self.pool.supports_rebalance:
            raise NotImplementedError(f"{type(self.pool).__name__} cannot rebalance (supports_rebalance=False)")
        with self._lock:
            self._manual_moves = dict(moves)
            self._lock.notify_all()
        while True:
            with self._lock:
                if self._manual_moves is None:
                    err, self._manual_err = self._manual_err, None
                    break
            time.sleep(0.005)
        if err is not None:
            raise err

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

    def _planned_rebalance(self, decision: Decision) -> None:
        logger.info("planner: rebalance %d requests in %s (%s)", len(decision.moves), self.layout, decision.reason)
        try:
            self._apply_rebalance({m.request_id: m.dst for m in decision.moves})
        except ReconfigurationError as e:  # moved requests re-admitted where they were: keep generating
            logger.error("%s", e)
            self.planner.cancel(decision)

    def _apply_rebalance(self, moves: dict[str, int]) -> None:
        try:
            result = self.pool.rebalance(moves, self._assignment)
        except ReconfigurationError as e:
            self._stage.num_failed_rebalances += 1
            self._assignment = dict(e.assignment)
            raise
        self._assignment = {rid: result.assignment[rid] for rid in self._assignment}
        self._stage.record_rebalance(result.phase_s, len(moves), len(result.migrated), len(result.recomputed))

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
