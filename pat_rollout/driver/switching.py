"""Layout switches and rebalances as the driver applies them to its pool, and what the planner learns from them.

A switch is asked for by the planner (`_start_layout` before a stage's first dispatch, `_maybe_reconfigure` after
every poll) or by a caller (`RolloutDriver.reconfigure(tp)` / `rebalance(moves)`, run on the loop's thread). The
pool keeps every unfinished request; when a switch fails it rolls back and raises ReconfigurationError, whose
`assignment` says where each request runs now, and the driver keeps generating there (a planned switch is then
cancelled in the planner, so its hysteresis and per-stage cap count only switches that happened).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING

from pat_rollout.driver.errors import ReconfigurationError
from pat_rollout.driver.planner_glue import cluster_state, poll_sample, prompt_key, start_state
from pat_rollout.planner.calibration import ReconfigSample

if TYPE_CHECKING:
    from pat_rollout.config import PatRolloutConfig
    from pat_rollout.driver.metrics import StageMetrics
    from pat_rollout.driver.pool import Pool, ReconfigResult
    from pat_rollout.engine.base import EngineSnapshot, RunningInfo, StepResult
    from pat_rollout.layout import Layout
    from pat_rollout.planner import Decision, Planner
    from pat_rollout.types import ModelSpec, Request

logger = logging.getLogger(__name__)


class Switching:
    """The pool, the planner, where every unfinished request runs, and the switches between layouts. The base of
    `loop.DriverLoop`, whose dispatch and polls fill the bookkeeping this reads."""

    def __init__(self, config: PatRolloutConfig, spec: ModelSpec, base: Layout, pool: Pool,
                 planner: Planner | None) -> None:
        self.config = config
        self.spec = spec
        self.base = base  # where weight updates happen and stages start (unless the planner picks the start)
        self.pool = pool
        self.planner = planner  # None unless policy="pat"
        self._requests: dict[str, Request] = {}  # every unfinished request by id
        self._prompt_keys: dict[str, str] = {}  # request id -> prompt_key, hashed once at dispatch
        self._assignment: dict[str, int] = {}  # request id -> replica of the current layout
        self._progress: dict[str, RunningInfo] = {}  # request id -> its progress at the last poll
        self._snapshots: dict[int, EngineSnapshot] = {}  # replica -> its snapshot at the last poll (reports_load)
        self._engine_spec = pool.engine_spec()  # what the pool says its engines are configured with
        self._stage: StageMetrics | None = None  # the stage in progress
        self._num_polls = 0
        self.last_reconfig: ReconfigResult | None = None  # the latest switch
        self.samples: deque = deque(maxlen=4096)  # PollSample / ReconfigSample the planner calibrated from, newest last

    @property
    def layout(self) -> Layout:
        return self.pool.layout

    # ---- the planner's switches ------------------------------------------------------------------------------
    def _start_layout(self, batch: list[Request]) -> None:
        # Measurements are valid for this model on this pool's layouts; the planner forgets them otherwise.
        self.planner.calibration.bind((self.spec, self.config.num_devices, self.config.tp_sizes))
        keys = {r.request_id: prompt_key(r.prompt_token_ids) for r in batch}
        step = self._num_polls * self.config.steps_per_poll
        decision = self.planner.choose_start(start_state(step, self.config.num_devices, self.layout.tp_size, batch,
                                                         keys, self._entry_costs()))
        if decision is None:
            return
        logger.info("planner: %s -> TP%d (%s)", self.layout, decision.target_tp, decision.reason)
        try:
            self._apply_reconfigure(decision.target_tp)
        except ReconfigurationError as e:  # rolled back to the base layout: start there
            self.planner.cancel(decision)
            logger.error("%s", e)

    def _entry_costs(self) -> tuple[tuple[int, float], ...]:
        """One-time costs the pool would still pay on entering each layout (Pool.entry_cost_s), the non-zero ones."""
        return tuple((tp, s) for tp in self.config.tp_sizes if (s := self.pool.entry_cost_s(tp)) > 0)

    def _maybe_reconfigure(self) -> None:
        state = cluster_state(self._num_polls * self.config.steps_per_poll, self.config.num_devices,
                              self.layout.tp_size, self._requests, self._progress, self._prompt_keys,
                              self._assignment, snapshots=(self._snapshots or None) if self.pool.reports_load else None,
                              reported_spec=self._engine_spec, entry_s=self._entry_costs())
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

    def _planned_rebalance(self, decision: Decision) -> None:
        logger.info("planner: rebalance %d requests in %s (%s)", len(decision.moves), self.layout, decision.reason)
        try:
            self._apply_rebalance({m.request_id: m.dst for m in decision.moves})
        except ReconfigurationError as e:  # moved requests re-admitted where they were: keep generating
            logger.error("%s", e)
            self.planner.cancel(decision)

    # ---- applying a switch -----------------------------------------------------------------------------------
    def _to_base(self) -> None:
        if self.layout != self.base:
            self.pool.reconfigure(self.base.tp_size, self._assignment)

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
            self._stage.record_layout(str(self.layout), self.pool.kv_tokens)
            raise
        self.last_reconfig = result
        self._record_reconfig(src_tp, num_tokens, time.perf_counter() - t0)
        self._assignment = {rid: result.assignment[rid] for rid in self._assignment}
        self._stage.record_reconfig(result, str(self.layout), self.pool.kv_tokens)

    def _apply_rebalance(self, moves: dict[str, int]) -> None:
        try:
            result = self.pool.rebalance(moves, self._assignment)
        except ReconfigurationError as e:
            self._stage.num_failed_rebalances += 1
            self._assignment = dict(e.assignment)
            raise
        self._assignment = {rid: result.assignment[rid] for rid in self._assignment}
        self._stage.record_rebalance(result.phase_s, len(moves), len(result.migrated), len(result.recomputed))

    # ---- what the planner calibrates from ----------------------------------------------------------------------
    def _record_poll(self, results: dict[int, tuple[StepResult, EngineSnapshot]], elapsed_s: float) -> None:
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
