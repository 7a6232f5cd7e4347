"""`RolloutDriver`: the public API of a PAT rollout pool (what verl's server actor, the demo, the benchmarks and the
tests call). It builds the pool through the backend registry (`driver.backends`) and the planner
(`driver.planner_glue`), then hands work to the loop thread (`driver.loop`) and waits for it; every method here
is thread-safe.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import time
from collections.abc import Iterable
from typing import Any

from pat_rollout.config import PatRolloutConfig
from pat_rollout.driver.backends import get_backend
from pat_rollout.driver.errors import PoolBrokenError, ReconfigurationError, WorkerError
from pat_rollout.driver.loop import DriverLoop
from pat_rollout.driver.planner_glue import build_planner, load_profile
from pat_rollout.kv.cost import handoff_cost
from pat_rollout.layout import Layout
from pat_rollout.types import Request, RequestOutput

logger = logging.getLogger(__name__)


class RolloutDriver(DriverLoop):
    """A PAT rollout pool of `config.num_devices` devices. Thread-safe `submit`; blocking `generate`.

    Reliability: every RPC has a deadline (config.rpc_deadline_s), every request's future resolves (a
    result, or an error naming the phase and devices), a pool that cannot serve any more is marked broken
    and every call then raises at once, and after `shutdown()` every call raises at once."""

    def __init__(self, config: PatRolloutConfig, *, num_cpus_per_worker: float = 1) -> None:
        config.planner_config()  # unknown planner options fail under every policy, before any actor starts
        base = Layout.uniform(config.num_devices, config.initial_tp)
        backend = get_backend(config.backend)
        spec = backend.model_spec(config)  # a bad checkpoint or TP size fails here, before anything starts
        needs_profile = config.policy == "pat" or (config.kv_handoff == "auto" and len(config.tp_sizes) > 1)
        self.profile = load_profile(config, backend.DEFAULT_PROFILE) if needs_profile else None
        planner = build_planner(config, spec, self.profile) if config.policy == "pat" else None
        cost = handoff_cost(self.profile) if self.profile else None
        pool = backend.build_pool(config, spec, base, cost=cost, num_cpus_per_worker=num_cpus_per_worker)
        if planner is not None:
            planner.can_rebalance = pool.supports_rebalance
        self._released: set[str] = set()  # release() tags not resumed yet
        super().__init__(config, spec, base, pool, planner)
        self._thread.start()

    @property
    def assignment(self) -> dict[str, int]:
        """A copy of request id -> replica of every unfinished request."""
        return dict(self._assignment)

    @property
    def broken(self) -> str | None:
        """Why the pool cannot serve any more, or None while it can."""
        return self._broken

    # ---- requests --------------------------------------------------------------------------------------------
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

    def abort_all(self) -> list[RequestOutput]:
        self._check_usable()
        with self._lock:
            self._abort = True
            self._lock.notify_all()
        self._wait_idle()
        return self._aborted

    # ---- manual control (the planner switches by itself) -----------------------------------------------------
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

    # ---- weights and memory (the pool idle) ------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Load new full weights (one bucket of an update) on every device, in the layout the next stage will start
        in: the planner's `next_start_tp` where the pool loads in any layout (Pool.weights_in_any_layout), so that
        stage starts without a switch; else the base layout. Only a bucket that finds the pool in another layout
        switches it first (nothing runs: the old weights are resharded); if that switch fails the pool is back in
        its base layout and the bucket loads there (warned)."""
        self._wait_idle()
        with self._guard():
            tp = self._weights_tp()
            if tp != self.layout.tp_size:
                try:
                    self.pool.reconfigure(tp, self._assignment)
                except ReconfigurationError as e:
                    logger.warning("update_weights: switching to TP%d failed, loading in %s instead: %s", tp,
                                   self.layout, e)
            self.pool.update_weights(list(named_tensors))

    def _weights_tp(self) -> int:
        if self.pool.weights_in_any_layout and self.planner is not None:
            tp = self.planner.next_start_tp()
            if tp is not None:
                return tp
        return self.base.tp_size

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

    # ---- state -----------------------------------------------------------------------------------------------
    def stage_metrics(self) -> dict[str, Any]:
        stage = self._last_stage or self._stage
        return stage.as_dict() if stage else {}

    def worker_info(self) -> list[dict[str, Any]]:
        self._check_usable()
        return self.pool.info()

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

    # ---- helpers ---------------------------------------------------------------------------------------------
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
