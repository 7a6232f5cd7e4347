"""What to do now: stay, rebalance requests across the current replicas, or regroup to another TP (grow or
shrink), and in which layout to start each stage. Compares the predicted remaining time of every action plus its
overhead and acts only when the predicted saving beats a margin, with hysteresis. Estimates come from the profile
corrected by what the pool measured (`calibration.py`), by one of two estimators (`PlannerConfig.estimator`):
- "drain" (default): the closed-form drain (`estimator.py`), every request decoding from now on at its predicted
  mean length, no KV capacity, admission or prefill; cheap enough to run synchronously every poll.
- "lookahead": the rest of the stage simulated with the engine's mechanics (`lookahead.py`), lengths drawn from
  the predictor's distribution; closer to the engine where KV capacity binds, but tens of ms per decide().
The configuration is planner/config.py's PlannerConfig. Pure stdlib, deterministic."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from pat_rollout.kv.cost import handoff_cost
from pat_rollout.planner.calibration import Calibration, CalibrationConfig, PollSample, ReconfigSample
from pat_rollout.planner.config import PlannerConfig
from pat_rollout.planner.cost import TransitionCost, prefers_migration, transition_cost
from pat_rollout.planner.engine_spec import EngineSpec
from pat_rollout.planner.estimator import drain_s, start_drain_s
from pat_rollout.planner.lookahead import Lookahead
from pat_rollout.planner.lookahead import build as build_lookahead
from pat_rollout.planner.margin import MarginTracker
from pat_rollout.planner.predictor import LengthPredictor
from pat_rollout.planner.rebalance import RebalanceOption, rebalance_option
from pat_rollout.planner.state import ClusterState, Decision
from pat_rollout.profile.model import LatencyModel

logger = logging.getLogger(__name__)

@dataclass(frozen=True, kw_only=True, slots=True)
class Option:
    """One candidate layout as evaluated: predicted remaining seconds after switching, the switch cost, and for a
    shrink the cost of growing back (`return_s`): a draining batch wants the larger TP again for its tail, so a
    shrink pays only when it covers the round trip."""

    tp: int
    remaining_s: float
    cost: TransitionCost
    allowed: bool
    why_not: str
    return_s: float = 0.0
    remaining_steps: int | None = None  # the lookahead's drain steps after switching (None: drain estimator)

    @property
    def total_s(self) -> float:
        return self.remaining_s + self.cost.total_s + self.return_s


class Planner:
    """Decides reconfigurations for one pool. Per stage: `start_stage()`, feed `observe_finished` as requests
    finish, call `decide(state)` every poll. A returned Decision is assumed applied at `state.step`.
    `can_rebalance`: the pool it plans for can move requests between replicas (pool.supports_rebalance).
    `engine`: the engine's scheduler rules and per-replica KV capacity, read by the lookahead estimator only
    (default: EngineSpec.default_for)."""

    def __init__(self, model: LatencyModel, config: PlannerConfig, predictor: LengthPredictor | None = None, *,
                 can_rebalance: bool = False, engine: EngineSpec | None = None) -> None:
        missing = sorted(set(config.candidate_tps) - set(model.tps))
        if missing:
            raise ValueError(f"candidate_tps={config.candidate_tps}: tps {missing} are not in the profile "
                             f"(profiled tps={model.tps})")
        self.model = model
        self.config = config
        self.predictor = predictor or LengthPredictor(config.predictor)
        self.calibration = Calibration(CalibrationConfig(alpha=config.calibration_alpha, enabled=config.calibrate))
        self.can_rebalance = can_rebalance
        self.uses_lookahead = config.estimator == "lookahead"
        self.last_estimator = "drain"  # the estimator of the latest evaluation ("drain" or "lookahead")
        self.last_lookahead: Lookahead | None = None  # the lookahead of the latest evaluation, if one was used
        self._bound_memo: tuple[ClusterState, frozenset[int]] | None = None  # bound_tps of the latest state asked
        self._pred_memo: tuple[ClusterState, int, dict[str, int]] | None = None  # predict_remaining's latest
        if engine is None and config.estimator != "drain":
            engine = EngineSpec.default_for(model, model.tps)
        self.engine = engine
        self._handoff = handoff_cost(model)
        self._migrates_memo: dict[tuple[int, int], bool] = {}
        self.margin = MarginTracker(config.margin, config.min_gain_ratio)
        self.last_start_tp: int | None = None  # the TP the latest stage started in, as choose_start picked it
        self._start_total: dict[int, float] = {}  # the latest stage start's predicted seconds per layout
        self._start_bound: frozenset[int] = frozenset()  # and the layouts its batch outgrows
        self._landed: int | None = None  # the layout next_start_tp gave (the weights land there), until used
        self.start_stage()

    def start_stage(self) -> None:
        """Reset per-stage state (switch history, evaluation clock, batch statistics); the stage that ended scores
        the estimate's error (the switch margin, planner/margin.py)."""
        self.margin.end_stage(self.calibration.metrics().get("pat/calibrated_error", 0.0))  # no-op when fresh
        self.switches: list[tuple[int, int, int]] = []  # (step, tp_src, tp_dst)
        self.last_options: tuple[Option, ...] = ()
        self.rebalances: list[int] = []  # steps of this stage's rebalances
        self.last_rebalance: RebalanceOption | None = None
        self._last_eval_step: int | None = None
        self.last_estimator = "drain"
        self.start_decision: Decision | None = None
        self.start_step: int | None = None  # step of this stage's start switch (a switch for min_steps_between_...)
        self.start_explored = False
        self.stay_steps: int | None = None  # the lookahead's drain steps of staying, at the last evaluation
        self.start_steps: dict[int, int] = {}  # the lookahead's drain steps of each starting layout
        self.predictor.start_stage()
        self.calibration.start_stage()

    @property
    def num_reconfigs(self) -> int:
        return len(self.switches)

    def cancel(self, decision: Decision) -> None:
        """The driver could not apply `decision` (rolled back): forget the switch so hysteresis and the
        per-stage cap count only switches that happened."""
        if decision is self.start_decision:
            self.start_decision = self.start_step = None
            self.start_explored = False
            self.last_start_tp = None  # the pool rolled back to its base layout
            return
        if decision.is_rebalance:
            if not self.rebalances or self.rebalances[-1] != decision.step:
                raise ValueError(f"rebalance at step={decision.step} is not the last recorded one; "
                                 f"rebalances={self.rebalances}")
            self.rebalances.pop()
            return
        if not self.switches or self.switches[-1] != (decision.step, decision.source_tp, decision.target_tp):
            raise ValueError(f"decision step={decision.step} tp {decision.source_tp}->{decision.target_tp} is not "
                             f"the last recorded switch; switches={self.switches}")
        self.switches.pop()

    def observe_finished(self, prompt_key: str | None, num_output_tokens: int) -> None:
        """A request of this stage finished with `num_output_tokens` tokens."""
        self.predictor.observe_finished(prompt_key, num_output_tokens)

    def observe_history(self, prompt_key: str, num_output_tokens: int) -> None:
        """A response length of `prompt_key` from an earlier RL iteration."""
        self.predictor.observe(prompt_key, num_output_tokens)

    def predict_remaining(self, state: ClusterState) -> dict[str, int]:
        """Predicted remaining output tokens of every unfinished request. Memoised for the latest state asked (an
        evaluation asks it several times) while no request finished since; requests with the same (generated,
        max_new_tokens, prompt) get the same prediction, computed once."""
        memo = self._pred_memo
        version = self.predictor.version
        if memo is not None and memo[0] is state and memo[1] == version:
            return memo[2]
        self.predictor.set_running(r.num_output_tokens for r in state.requests)
        predict = self.predictor.predict_remaining
        seen: dict[tuple[int, int, str | None], int] = {}
        out = {}
        for r in state.requests:
            key = (r.num_output_tokens, r.max_new_tokens, r.prompt_key)
            x = seen.get(key)
            if x is None:
                x = seen[key] = predict(*key)
            out[r.request_id] = x
        self._pred_memo = (state, self.predictor.version, out)
        return out

    def lookahead(self, state: ClusterState) -> Lookahead:
        """This poll's lookahead: the requests bundled into units, each unit's final length drawn from the
        predictor at a stratified quantile, on the calibrated profile and the engine's spec (as the pool reported
        it in `state`, else `self.engine`, else EngineSpec.default_for)."""
        self.predictor.set_running(r.num_output_tokens for r in state.requests)
        model = self.estimator_model()
        spec = state.reported_spec or self.engine or EngineSpec.default_for(self.model, self.model.tps)
        return build_lookahead(
            step=model, spec=spec, num_devices=state.num_devices, requests=state.requests,
            draw=lambda r, q: self.predictor.sample_remaining(r.num_output_tokens, r.max_new_tokens, r.prompt_key, q),
            config=self.config.lookahead,
            migrates=self.migrates)

    def migrates(self, num_tokens: int, tp_dst: int) -> bool:
        """The driver's hand-off rule (planner.cost.prefers_migration with this profile), memoised: the
        lookahead asks it for every request of every candidate layout at every poll."""
        key = (num_tokens, tp_dst)
        out = self._migrates_memo.get(key)
        if out is None:
            out = self._migrates_memo[key] = prefers_migration(self.model, tp_dst, num_tokens, self._handoff)
        return out

    def evaluate(self, state: ClusterState, la: Lookahead | None = None) -> tuple[float, tuple[Option, ...]]:
        """Predicted remaining seconds if we stay, and every candidate layout (no evaluation clock), by the
        configured estimator (`la` given: that lookahead). "auto", by `bound_tps`: in a capacity-bound layout the
        lookahead scores every layout, and only grows are allowed (the batch has not drained; the lookahead's
        drawn tails make a shrink's gain its least sure figure); in a fitting layout the drain estimate scores
        them and a bound layout is not allowed (the drain estimate ignores KV room: it is optimistic exactly
        there). The lookahead used (or None) is left in `last_lookahead`.
        drain: a regroup's cost charges every request's context to the hand-off (migrated or recomputed).
        lookahead: its cost is the pause (reshard, migration of the KV the hand-off rule moves, switch);
        re-prefill of the rest is paid inside the lookahead, through admission."""
        est = self.config.estimator
        bound = self.bound_tps(state) if est == "auto" and la is None else frozenset()
        if la is None and (est == "lookahead" or (state.tp in bound and self.config.auto_lookahead_mid_stage)):
            la = self.lookahead(state)
        now_s, options = self._evaluate(state, la)
        if bound:
            out = []
            for o in options:
                if o.allowed and state.tp in bound and o.tp < state.tp:
                    o = dataclasses.replace(o, allowed=False, why_not=f"capacity-bound in tp={state.tp}: no shrink")
                elif o.allowed and state.tp not in bound and o.tp in bound:
                    o = dataclasses.replace(o, allowed=False, why_not=f"the batch outgrows tp={o.tp}'s KV room")
                out.append(o)
            options = tuple(out)
        self.last_lookahead = la
        self.last_estimator = "drain" if la is None else "lookahead"
        return now_s, options

    def _evaluate(self, state: ClusterState, la: Lookahead | None) -> tuple[float, tuple[Option, ...]]:
        model = self.estimator_model()
        tokens = [r.num_tokens for r in state.requests]
        if la is not None:
            now_s = la.stay_s(state.tp)
            self.stay_steps = la.last_steps
            regroup_s = la.regroup_s  # (remaining seconds, tokens of the requests whose KV the hand-off migrates)
        else:
            pred = self.predict_remaining(state)
            remaining = [pred[r.request_id] for r in state.requests]
            reps = [r.replica for r in state.requests]
            known = None if any(x is None for x in reps) else [int(x) for x in reps]  # type: ignore[arg-type]
            now_s = drain_s(model, tp=state.tp, num_devices=state.num_devices, remaining=remaining,
                            num_tokens=tokens, replicas=known)

            def regroup_s(tp: int) -> tuple[float, list[int]]:
                return drain_s(model, tp=tp, num_devices=state.num_devices, remaining=remaining,
                               num_tokens=tokens), tokens
        options = []
        for tp in sorted(self.config.candidate_tps):
            if tp == state.tp or state.num_devices % tp:
                continue
            why_not = self._why_not(state, tp)
            remaining_s, handed_off = regroup_s(tp)
            steps = la.last_steps if la is not None else None
            cost = self._entered(self._cost(model, state.num_devices, state.tp, tp, handed_off), state, tp)
            back = self._cost(model, state.num_devices, tp, state.tp, tokens).total_s if tp < state.tp else 0.0
            options.append(Option(tp=tp, remaining_s=remaining_s, cost=cost, allowed=not why_not, why_not=why_not,
                                  return_s=back, remaining_steps=steps))
        return now_s, tuple(options)

    def bound_tps(self, state: ClusterState) -> frozenset[int]:
        """The layouts (the current one and the candidates) whose KV room the batch outgrows: the predicted peak
        of KV tokens held (`kv_peak`: every request decoding from now on for its predicted mean remaining
        length), spread over the layout's replicas, above what one replica holds (the engine's spec:
        `state.reported_spec`, else the planner's; none known: nothing is bound). Memoised per state."""
        memo = self._bound_memo
        if memo is not None and memo[0] is state:
            return memo[1]
        spec = state.reported_spec or self.engine
        bound: frozenset[int] = frozenset()
        if spec is not None and state.requests:
            pred = self.predict_remaining(state)
            peak = kv_peak([(r.num_tokens, pred[r.request_id]) for r in state.requests])
            tps = {state.tp, *(tp for tp in self.config.candidate_tps if state.num_devices % tp == 0)}
            bound = frozenset(tp for tp in tps if tp in spec.kv_tokens
                              and peak / (state.num_devices // tp) > spec.capacity(tp))
        self._bound_memo = (state, bound)
        return bound

    def estimator_model(self) -> LatencyModel:
        """The profile as corrected by this pool's measurements so far."""
        return self.calibration.model(self.model)

    def _cost(self, model: LatencyModel, num_devices: int, tp_src: int, tp_dst: int,
              num_tokens: list[int]) -> TransitionCost:
        cost = transition_cost(model, num_devices=num_devices, tp_src=tp_src, tp_dst=tp_dst, num_tokens=num_tokens,
                               migrates=self.migrates)
        return self.calibration.correct_cost(cost, tp_src, tp_dst)

    @staticmethod
    def _entered(cost: TransitionCost, state: ClusterState, tp: int) -> TransitionCost:
        """`cost` plus the one-time cost the pool still pays on entering `tp` (ClusterState.entry_s)."""
        extra = state.entry_cost_s(tp) if tp != state.tp else 0.0
        return dataclasses.replace(cost, switch_s=cost.switch_s + extra) if extra else cost

    # ---- measurements and the stage's starting layout -------------------------------------------
    def observe_poll(self, sample: PollSample) -> None:
        """A decode poll the pool measured (corrects decode-step estimates from now on)."""
        self.calibration.observe_poll(self.model, sample)

    def observe_reconfig(self, sample: ReconfigSample) -> None:
        """A reconfiguration the pool measured (corrects overhead estimates from now on)."""
        self.calibration.observe_reconfig(self.model, sample)

    def start_options(self, state: ClusterState) -> dict[int, tuple[float, TransitionCost]]:
        """For every candidate TP: predicted seconds to dispatch, prefill and drain the batch of `state` (requests
        not started, replica unknown) in that layout, and the cost of switching there from `state.tp` with nothing
        running. The estimator as in `evaluate`: under "auto", the lookahead when the layout the drain estimate
        picks or the one the pool is in is capacity-bound (the start layout then follows the batch's size, its
        prompts and max_new_tokens through the predictor, the KV room per layout and the profile)."""
        model = self.estimator_model()
        self.start_steps = {}
        est = self.config.estimator
        tps = [tp for tp in sorted(self.config.candidate_tps) if state.num_devices % tp == 0]
        bound = self.bound_tps(state) if est == "auto" else frozenset()
        out = self._start_options(state, model, tps, est == "lookahead" or state.tp in bound)
        if est == "auto" and self.last_estimator == "drain":
            if min((run_s + cost.total_s, tp) for tp, (run_s, cost) in out.items())[1] in bound:
                out = self._start_options(state, model, tps, True)
        return out

    def _start_options(self, state: ClusterState, model: LatencyModel, tps: list[int],
                       lookahead: bool) -> dict[int, tuple[float, TransitionCost]]:
        self.last_estimator = "lookahead" if lookahead else "drain"
        if lookahead:
            la = self.lookahead(state)

            def run_s(tp: int) -> float:
                out = la.stay_s(tp)
                self.start_steps[tp] = la.last_steps
                return out
        else:
            pred = self.predict_remaining(state)
            remaining = [pred[r.request_id] for r in state.requests]
            tokens = [r.num_tokens for r in state.requests]
            prompt_tokens = sum(r.num_prompt_tokens for r in state.requests)

            def run_s(tp: int) -> float:
                return start_drain_s(model, tp=tp, num_devices=state.num_devices, remaining=remaining,
                                     num_tokens=tokens, prompt_tokens=prompt_tokens)
        return {tp: (run_s(tp), self._entered(self._cost(model, state.num_devices, state.tp, tp, []), state, tp))
                for tp in tps}

    def choose_start(self, state: ClusterState) -> Decision | None:
        """The layout to start this stage's batch in (before any request is dispatched), or None to stay at
        `state.tp`. The first stage (no start chosen before: the pool is in its base layout) takes the layout
        predicted fastest, switch included; later stages stay unless another layout is predicted to save more than
        the margin. Where the weights landed and where the stage starts are one decision: the pool in the layout
        `next_start_tp` gave is left at 0 s only for a predicted saving beyond the margin, never to explore.
        Exploring (see explore_max_ratio) a layout never measured here: in place when the pool is in one (the
        weights landed there to explore it, or its base layout is one), by a switch only when the pool is not where
        the planner put it (a pool that loads weights in its base layout only); never into a layout the stage's
        rules would not let it leave for the chosen one (`_leavable`). Not counted against
        max_reconfigs_per_stage; the next switch waits min_steps_between_switches after it, and an explored layout
        is not left before a poll in it was measured (else the next stage would explore it again). The layout the
        pool came from is not "left" for no_return_steps: the previous stage chose it, not this batch."""
        cfg = self.config
        if not cfg.start_layout or not state.requests:
            return None
        options = self.start_options(state)
        total = {tp: run_s + cost.total_s for tp, (run_s, cost) in options.items()}
        best = min(total, key=lambda tp: (total[tp], tp))
        why = "predicted fastest"
        # The margin keeps a layout some stage started in (`last_start_tp`: the weights were loaded there for this
        # stage). The first stage's layout is the pool's base, which no estimate chose: the predicted fastest wins.
        chosen = self.last_start_tp is not None
        if chosen and state.tp in total and total[state.tp] - total[best] <= max(cfg.min_gain_s,
                                                                                self.margin.ratio * total[state.tp]):
            best = state.tp
        bound = self.bound_tps(state) if cfg.estimator == "auto" else frozenset()
        if best in bound and best != state.tp:
            # A capacity-bound stage may grow but not shrink (`evaluate`), so a start is a one-way door upward:
            # of the layouts predicted within the margin of the fastest, the smallest keeps the stage free to grow
            # when the profile proves optimistic about larger TPs (their efficiency is its least sure figure).
            near = [tp for tp in total if tp < best
                    and total[tp] - total[best] <= max(cfg.min_gain_s, self.margin.ratio * total[tp])]
            if near:
                best = min(near)
                why = "the smallest layout within the margin of the fastest (capacity-bound: it can only grow)"
        self._start_total, self._start_bound, self.last_start_tp = total, bound, best
        observed = self.calibration.observed_tps()
        if cfg.calibrate and observed and best in observed:
            unobserved = self._explorable(best, total, bound, observed)
            if state.tp in unobserved:
                best = state.tp  # explore in place: no switch
                self.start_explored = True
            elif state.tp != self._landed and unobserved:
                best = min(unobserved, key=lambda tp: (total[tp], tp))
                self.start_explored = True
                why = f"never measured on this pool (TPs measured: {sorted(observed)}): exploring"
        self._landed = None
        self.margin.predict(state.step, _plus(state.step, self.start_steps.get(best)), new_action=True)
        if best == state.tp:
            return None
        run_s, cost = options[best]
        now_s = total.get(state.tp, float("inf"))
        self.start_step = state.step
        self.start_decision = Decision(
            step=state.step, source_tp=state.tp, target_tp=best, predicted_remaining_now_s=now_s,
            predicted_remaining_target_s=run_s, predicted_overhead_s=cost.total_s,
            reason=f"stage start, {len(state.requests)} requests: tp={best} {why} ({run_s:.2f}s + "
                   f"{cost.total_s:.3f}s switch; " + ", ".join(f"tp={tp} {t:.2f}s" for tp, t in total.items()) + ")")
        return self.start_decision

    def _explorable(self, best: int, total: dict[int, float], bound: frozenset[int], observed) -> list[int]:
        """The layouts of `total` a start may explore instead of `best`: never measured here (not in `observed`),
        predicted within explore_max_ratio of `best`, and leavable for `best` by the stage's rules."""
        limit = self.config.explore_max_ratio * total[best]
        return [tp for tp in total if tp not in observed and total[tp] <= limit and self._leavable(tp, best, bound)]

    def _leavable(self, tp: int, dst: int, bound: frozenset[int]) -> bool:
        """Whether a stage in `tp` may switch to `dst` by the running stage's rules (only_grow; under "auto", no
        shrink from a capacity-bound layout, no move from a fitting one into a bound one)."""
        if tp == dst:
            return True
        if self.config.only_grow and dst < tp:
            return False
        return not ((tp in bound and dst < tp) or (tp not in bound and dst in bound))

    def next_start_tp(self) -> int | None:
        """The TP the next stage is expected to start in, for the weight update to load into so that the stage
        starts without a switch: the one choose_start picked for the latest stage (it keeps the layout the pool is
        in unless another saves more than the margin), or, where a layout never measured here is within
        explore_max_ratio of it by the latest stage's start estimate and may be left for it, that layout (the
        next stage explores it in place: the landing is the exploration, with no switch at 0 s). None before any
        stage chose one, after its start switch rolled back, or with start_layout off (stages then start in the
        base layout)."""
        if not self.config.start_layout or self.last_start_tp is None:
            return None
        best, cfg, total = self.last_start_tp, self.config, self._start_total
        observed = self.calibration.observed_tps()
        out = best
        if cfg.calibrate and observed and best in observed and best in total:
            unobserved = self._explorable(best, total, self._start_bound, observed)
            if unobserved:
                out = min(unobserved, key=lambda tp: (total[tp], tp))
        self._landed = out
        return out

    def stage_metrics(self, prefix: str = "pat") -> dict[str, float]:
        """Calibration and starting-layout metrics of the current stage."""
        out = self.calibration.metrics(prefix)
        out[f"{prefix}/start_explored"] = float(self.start_explored)
        return out

    def _why_not(self, state: ClusterState, tp: int) -> str:
        cfg = self.config
        if cfg.only_grow and tp < state.tp:
            return "only_grow"
        if len(self.switches) >= cfg.max_reconfigs_per_stage:
            return f"max_reconfigs_per_stage={cfg.max_reconfigs_per_stage} reached"
        last = self.switches[-1][0] if self.switches else self.start_step
        if last is not None and state.step - last < cfg.min_steps_between_switches:
            return f"last switch at step {last} < min_steps_between_switches={cfg.min_steps_between_switches} ago"
        if self.start_explored and not self.switches and state.tp not in self.calibration.observed_tps():
            return f"exploring tp={state.tp}: no poll measured in it yet"
        for step, src, _ in reversed(self.switches):
            if src == tp and state.step - step < cfg.no_return_steps:
                return f"left tp={tp} at step {step} < no_return_steps={cfg.no_return_steps} ago"
        return ""

    def _due(self, step: int) -> bool:
        """The evaluation clock: whether `step` is far enough from the last evaluation."""
        every = self.config.eval_every_steps
        if self.config.estimator == "auto" and self.last_estimator == "lookahead":
            every = max(every, self.config.lookahead_every_steps)  # a capacity-bound stage changes slowly
        return self._last_eval_step is None or step - self._last_eval_step >= every

    def idle(self, step: int) -> bool:
        """True when `decide` at `step` returns None whatever the state (the evaluation clock is not due); records
        the poll as `decide` does. A caller whose ClusterState is costly to build asks this first."""
        if self._due(step):
            return False
        self.margin.seen(step)
        return True

    def decide(self, state: ClusterState) -> Decision | None:
        """An action to apply now (a regroup or a rebalance), or None to stay. Evaluates at most once per
        eval_every_steps steps."""
        cfg = self.config
        self.margin.seen(state.step)
        if not state.requests or not self._due(state.step):
            return None
        self._last_eval_step = state.step
        rebalance_why_not = self._rebalance_why_not(state)
        if rebalance_why_not and not any(not self._why_not(state, tp) for tp in cfg.candidate_tps
                                         if tp != state.tp and state.num_devices % tp == 0):
            return None  # nothing allowed: skip the estimate
        now_s, options = self.evaluate(state)
        la = self.last_lookahead
        self.last_options = options
        allowed = [o for o in options if o.allowed]
        margin = max(cfg.min_gain_s, self.margin.ratio * now_s)
        # ---- rebalance: chosen over the best regroup only when its remaining time plus overhead is lower
        self.last_rebalance = None if rebalance_why_not else self._rebalance_option(state, la)
        rb = self.last_rebalance
        if rb is not None and (not allowed or rb.total_s < min(o.total_s for o in allowed)):
            d = self._rebalance_decision(state, now_s, rb, margin)
            self.margin.predict(state.step, None if d else _plus(state.step, self.stay_steps), new_action=bool(d))
            return d
        # ---- regroup
        stay = _plus(state.step, self.stay_steps if la is not None else None)
        if not allowed:
            self.margin.predict(state.step, stay, new_action=False)
            return None
        # growing into a TP never measured on this pool: it may be as wrong as the profile proved on the measured
        # ones (a profile's error grows with TP: all-reduce latency, efficiency under load), so its predicted
        # remaining time counts that much more (0 while nothing is measured or the profile is right). A shrink
        # carries no such risk: smaller TPs are where profiles are surest, and a wrong start must be leavable.
        # Lookahead only: measured with it (sim_policies, h100/llama low variant); the drain path stays as it was.
        err = self.calibration.profile_error() if self.uses_lookahead else 0.0  # not "auto": measured on neither
        observed = self.calibration.observed_tps()

        def risk_s(o: Option) -> float:
            return 0.0 if o.tp in observed or o.tp < state.tp else err * o.remaining_s

        best = min(allowed, key=lambda o: (o.total_s + risk_s(o), o.tp))
        saving = now_s - best.total_s - risk_s(best)
        if saving <= margin:
            logger.debug("step %d: stay at tp=%d (best tp=%d saves %.3fs <= margin %.3fs)", state.step, state.tp,
                         best.tp, saving, margin)
            self.margin.predict(state.step, stay, new_action=False)
            return None
        back = f" + {best.return_s:.3f}s to grow back" if best.return_s else ""
        if risk_s(best):
            back += f" + {risk_s(best):.2f}s for a TP not measured here (profile off by {err:.0%})"
        reason = (f"{len(state.requests)} requests left: tp={state.tp} needs {now_s:.2f}s, tp={best.tp} needs "
                  f"{best.remaining_s:.2f}s + {best.cost.total_s:.3f}s overhead (reshard {best.cost.reshard_s:.3f}s, "
                  f"kv {best.cost.kv_s:.3f}s, switch {best.cost.switch_s:.3f}s){back}; saving {saving:.2f}s > margin "
                  f"{margin:.2f}s")
        self.switches.append((state.step, state.tp, best.tp))
        self.margin.predict(state.step, _plus(state.step, best.remaining_steps), new_action=True)
        return Decision(step=state.step, source_tp=state.tp, target_tp=best.tp, predicted_remaining_now_s=now_s,
                        predicted_remaining_target_s=best.remaining_s, predicted_overhead_s=best.cost.total_s,
                        reason=reason)

    # ---- rebalance ---------------------------------------------------------------------------------
    def _rebalance_why_not(self, state: ClusterState) -> str:
        cfg = self.config
        if not (cfg.rebalance and self.can_rebalance):
            return "rebalance disabled" if not cfg.rebalance else "the pool cannot rebalance"
        if state.num_replicas < 2:
            return "one replica"
        if any(r.replica is None for r in state.requests):
            return "replicas of the requests unknown"
        if len(self.rebalances) >= cfg.max_rebalances_per_stage:
            return f"max_rebalances_per_stage={cfg.max_rebalances_per_stage} reached"
        starts = [] if self.start_step is None else [self.start_step]
        last = max([*self.rebalances, *starts, *(s for s, _, _ in self.switches)], default=None)
        if last is not None and state.step - last < cfg.min_steps_between_switches:
            return f"last action at step {last} < min_steps_between_switches={cfg.min_steps_between_switches} ago"
        return ""

    def _rebalance_option(self, state: ClusterState, la: Lookahead | None) -> RebalanceOption | None:
        """The moves planner.rebalance proposes, scored by the drain estimate on the predicted means (`la` None)
        or by the lookahead (Lookahead.rebalance_option)."""
        if la is not None:
            return la.rebalance_option(state.tp, self.estimator_model())
        pred = self.predict_remaining(state)
        return rebalance_option(self.estimator_model(), tp=state.tp, num_devices=state.num_devices,
                                request_ids=[r.request_id for r in state.requests],
                                replicas=[int(r.replica) for r in state.requests],  # type: ignore[arg-type]
                                remaining=[pred[r.request_id] for r in state.requests],
                                num_tokens=[r.num_tokens for r in state.requests])

    def _rebalance_decision(self, state: ClusterState, now_s: float, rb: RebalanceOption,
                            margin: float) -> Decision | None:
        saving = now_s - rb.total_s
        if saving <= margin:
            logger.debug("step %d: stay (rebalancing %d requests saves %.3fs <= margin %.3fs)", state.step,
                         len(rb.moves), saving, margin)
            return None
        reason = (f"{len(state.requests)} requests left: tp={state.tp} as assigned needs {now_s:.2f}s, moving "
                  f"{len(rb.moves)} needs {rb.remaining_s:.2f}s + {rb.cost.total_s:.3f}s overhead "
                  f"({rb.cost.num_migrated} migrated, {rb.cost.num_recomputed} recomputed); saving {saving:.2f}s > "
                  f"margin {margin:.2f}s")
        self.rebalances.append(state.step)
        return Decision(step=state.step, source_tp=state.tp, target_tp=state.tp, predicted_remaining_now_s=now_s,
                        predicted_remaining_target_s=rb.remaining_s, predicted_overhead_s=rb.cost.total_s,
                        reason=reason, action="rebalance", moves=rb.moves)


def kv_peak(requests: list[tuple[int, int]]) -> float:
    """Peak over the steps ahead of the KV tokens held by requests given as (tokens now, remaining tokens), all
    decoding from now on: at step t the requests with remaining > t hold tokens now + t; the maximum is reached
    just before one of them finishes."""
    items = sorted(requests, key=lambda x: -x[1])
    peak = held = 0.0
    for k, (now, rem) in enumerate(items, start=1):
        held += now
        peak = max(peak, held + k * rem)
    return peak


def _plus(step: int, steps: int | None) -> int | None:
    return None if steps is None else step + steps
