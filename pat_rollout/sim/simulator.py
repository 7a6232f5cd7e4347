"""Discrete-event simulation of one synchronous generation stage on `num_devices` devices.

The truth (`SimHardware`: step times, KV capacity, scheduler, driver loop, reconfiguration phases) is separate from
what a policy sees. A policy is asked at every poll with a `PollView` (the planner's ClusterState: progress
counts only, never true lengths, plus the requests that finished since the last poll) and answers an action or
None. Actions are records dispatched by type through `Sim.ACTIONS` (`Reconfigure(tp)`, `Rebalance(moves)`, the
oracle's `HindsightRebalance`, `Batch` of several; another action is one record class plus one handler registered
there). Before dispatch a policy with an `on_start(state)` hook picks the
stage's starting layout, as the driver's planner does; the view also carries what the pool "measured" since the
previous poll (calibration.PollSample / ReconfigSample from the true times), as the driver feeds its planner.
Dispatch at stage start calls the driver's own planner.balance.assign_new; a reconfiguration rebalances with
planner.balance.balance on context tokens, as the driver's Reconfigurer does. Pure stdlib.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pat_rollout.kv.cost import HandoffCost
from pat_rollout.planner.balance import assign_new, balance
from pat_rollout.planner.calibration import PollSample, ReconfigSample
from pat_rollout.planner.rebalance import Move, plan_moves
from pat_rollout.planner.state import ClusterState, Decision, ReqProgress
from pat_rollout.sim.hardware import SimHardware
from pat_rollout.sim.replica import Replica, SimReq
from pat_rollout.sim.traces import Trace

_REQ_FIELDS = operator.attrgetter(*(f.name for f in dataclasses.fields(SimReq)))


@dataclass(frozen=True, kw_only=True, slots=True)
class Reconfigure:
    """Switch the whole pool to TP `tp` now. `decision` is the planner's, kept for the report."""

    tp: int
    decision: Decision | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Rebalance:
    """Move unfinished requests between replicas of the current layout now (planner.rebalance.Move: request id,
    source and destination replica index as in the view's ClusterState). `decision` is the planner's."""

    moves: tuple[Move, ...]
    decision: Decision | None = None

    def __post_init__(self) -> None:
        if not self.moves:
            raise ValueError("Rebalance needs at least one move (moves=()): a rebalance that moves nothing is a stay")
        ids = [m.request_id for m in self.moves]
        if len(set(ids)) != len(ids):
            raise ValueError(f"Rebalance moves request(s) {sorted({i for i in ids if ids.count(i) > 1})} twice")


@dataclass(frozen=True, kw_only=True, slots=True)
class HindsightRebalance:
    """The oracle's rebalance (no policy that sees only a PollView can make it): a `Rebalance` with the moves
    planner.rebalance.plan_moves picks for the requests' TRUE remaining tokens, applied with that action's real
    costs; nothing when they are already balanced."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Batch:
    """Several actions applied in order at one poll (a replayed schedule with two entries due at once); one that no
    longer applies to the layout when its turn comes (`Sim.applies`) is skipped."""

    actions: tuple[Any, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class PollView:
    """What a policy sees at a poll: time, the layout's TP, the ClusterState a real driver would build, (prompt_key,
    length) of the requests that finished since the previous poll in finish order, and what the pool measured
    since then (decode polls without prefill, reconfigurations), as the driver's `_record_poll` /
    `_record_reconfig` report them. `state` is built on first access (a static policy never pays for it): read
    it inside `on_poll`, before the simulation moves on."""

    t: float
    tp: int
    finished: tuple[tuple[str, int], ...]
    num_unfinished: int
    num_total: int
    samples: tuple[PollSample | ReconfigSample, ...] = ()
    step: int = 0  # decode steps of the stage so far (the state's `step`)
    build_state: Callable[[], ClusterState] = field(repr=False, compare=False)
    _state: list[ClusterState] = field(default_factory=list, repr=False, compare=False)

    @property
    def state(self) -> ClusterState:
        if not self._state:
            self._state.append(self.build_state())
        return self._state[0]


class Policy(Protocol):
    """`initial_tp()`: the stage's layout when the policy has no `on_start(state) -> Reconfigure | None` hook (the
    pool returns there first); with the hook, the stage starts where the pool is unless the hook moves it."""

    name: str

    def initial_tp(self) -> int: ...

    def on_poll(self, view: PollView) -> Any: ...


@dataclass(kw_only=True, slots=True)
class SimResult:
    """Outcome of one policy: stage latency, layouts as (time s, tp), time paid pausing for actions (switches and
    rebalances; `rebalance_s` is the rebalances' part), and counts."""

    policy: str
    latency_s: float
    schedule: tuple[tuple[float, int], ...]
    overhead_s: float
    decisions: tuple[Decision, ...] = ()
    num_preempted: int = 0
    prefill_tokens: int = 0
    tail_start_s: float = 0.0  # when 90% of the requests had finished
    finish_times: tuple[float, ...] = field(default=(), repr=False)
    num_rebalances: int = 0
    num_rebalanced: int = 0  # requests moved by rebalances
    num_rebalance_migrated: int = 0  # of those, moved with their KV (the rest re-prefill on their destination)
    rebalance_s: float = 0.0

    @property
    def num_reconfigs(self) -> int:
        return len(self.schedule) - 1

    @property
    def tail_share(self) -> float:
        """Share of the stage spent after 90% of the requests finished."""
        return (self.latency_s - self.tail_start_s) / self.latency_s if self.latency_s > 0 else 0.0

    def layouts_str(self) -> str:
        return " -> ".join(f"TP{tp}@{t:.1f}s" for t, tp in self.schedule)


class Sim:
    """State of one stage under one policy; `run()` to the end (or until `stop(sim)` holds at a poll)."""

    def __init__(self, hw: SimHardware, trace: Trace, *, num_devices: int, policy: Policy,
                 handoff: HandoffCost | None = None, prev_tp: int | None = None) -> None:
        """`prev_tp`: the layout the previous stage ended in; the driver returns to the stage's initial layout
        first (a reconfiguration with no requests), inside this stage's time."""
        self.hw = hw
        self.num_devices = num_devices
        self.policy = policy
        self.handoff = handoff
        self.t = 0.0
        self.step = 0
        self.overhead = 0.0
        self.decisions: list[Decision] = []
        self.finish_times: list[float] = []
        self.num_total = len(trace.records)
        self.num_preempted = 0
        self.prefill_tokens = 0
        self.num_rebalances = self.num_rebalanced = self.num_rebalance_migrated = 0
        self.rebalance_s = 0.0
        self._pending: list[tuple[str, int]] = []
        self._samples: list[PollSample | ReconfigSample] = []
        reqs = [SimReq(rid=f"r{i}", prompt_key=rec.prompt_id, prompt_len=rec.prompt_len, length=rec.response_len,
                       max_new=rec.max_new_tokens or trace.max_new_tokens) for i, rec in enumerate(trace.records)]
        tp_in = prev_tp if prev_tp is not None else policy.initial_tp()
        self._check_tp(tp_in)
        on_start = getattr(policy, "on_start", None)
        start = on_start(self._start_state(reqs, tp_in)) if on_start else Reconfigure(tp=policy.initial_tp())
        self.tp = start.tp if start is not None else tp_in
        self._check_tp(self.tp)
        self.schedule: list[tuple[float, int]] = [(0.0, tp_in)]
        if self.tp != tp_in:  # a switch with nothing running, inside this stage's time (as the driver does it)
            self.t = self.overhead = self._phase_s(tp_in, self.tp, 0)
            self.schedule.append((0.0, self.tp))
            self._samples.append(ReconfigSample(num_devices=num_devices, tp_src=tp_in, tp_dst=self.tp,
                                                num_tokens=(), elapsed_s=self.t))
            if start is not None and start.decision is not None:
                self.decisions.append(start.decision)
        self.replicas = [Replica(hw, self.tp, self.t) for _ in range(num_devices // self.tp)]
        self.where: dict[str, int] = {}
        for r, rep in zip(reqs, assign_new([0] * len(self.replicas), [1] * len(reqs))):  # least-inflight
            self.replicas[rep].waiting.append(r)
            self.where[r.rid] = rep

    def _start_state(self, reqs: list[SimReq], tp: int) -> ClusterState:
        """The batch as the driver's planner sees it before dispatch (driver.planner_glue.start_state)."""
        return ClusterState(step=0, num_devices=self.num_devices, tp=tp, requests=tuple(
            ReqProgress(request_id=r.rid, prompt_key=r.prompt_key, num_prompt_tokens=r.prompt_len,
                        num_output_tokens=0, max_new_tokens=r.max_new) for r in reqs))

    def _check_tp(self, tp: int) -> None:
        if tp < 1 or self.num_devices % tp:
            raise ValueError(f"tp={tp} must divide num_devices={self.num_devices}")

    @property
    def num_unfinished(self) -> int:
        return self.num_total - len(self.finish_times)

    def _advance(self) -> None:
        """One poll interval of generation."""
        d = self.hw.driver
        busy = [rep for rep in self.replicas if rep.busy]
        before = {id(rep): (max(rep.t, self.t), rep.steps, rep.decode_tokens, rep.prefill_tokens) for rep in busy}
        slow = d.concurrency_slowdown if len(busy) > 1 else 1.0
        if d.lockstep:
            t0 = self.t
            for rep in busy:
                rep.t, rep.slowdown = self.t, slow
                rep.run(d.steps_per_poll)
            self.t = max(rep.t for rep in busy) + d.poll_overhead_s
            self.step += d.steps_per_poll
            self._record_poll(busy, before, self.t - t0)
        else:
            t_next = self.t + d.poll_interval_s
            for rep in busy:
                rep.t = max(rep.t, self.t)
                rep.run(1 << 30, until_t=t_next)
            ends = [rep.t for rep in busy]
            self.step = max(self.step, self._base_step + max(rep.steps for rep in self.replicas))
            self.t = t_next if any(rep.busy for rep in self.replicas) else max(ends)
            for rep in busy:  # free-running replicas: each one is its own measurement
                self._record_poll([rep], before, rep.t - before[id(rep)][0])
        for rep in busy:
            for t_fin, r in rep.finished:
                self.finish_times.append(min(t_fin, self.t) if not d.lockstep else self.t)
                self._pending.append((r.prompt_key, r.length))
                self.where.pop(r.rid, None)
            rep.finished.clear()

    def _record_poll(self, reps: list[Replica], before: dict, elapsed_s: float) -> None:
        """What the driver's poll_sample would report: nothing when a replica prefilled or finished a request in the
        poll or none ran the whole poll; else each replica's mean batch and its mean context at mid-poll."""
        steps = max(rep.steps - before[id(rep)][1] for rep in reps)
        if steps < 1 or elapsed_s <= 0 or any(rep.prefill_tokens > before[id(rep)][3] or rep.finished for rep in reps):
            return
        stats = []
        for rep in reps:
            _, s0, dec0, _ = before[id(rep)]
            if rep.steps - s0 != steps or not rep.running:
                continue
            ctx = sum(r.prompt_len + r.g for r in rep.running) / len(rep.running)
            stats.append(((rep.decode_tokens - dec0) / steps, max(0.0, ctx - steps / 2.0)))
        if stats:
            self._samples.append(PollSample(tp=self.tp, replicas=tuple(stats), num_steps=steps, elapsed_s=elapsed_s))

    _base_step = 0

    def view(self) -> PollView:
        v = PollView(t=self.t, tp=self.tp, finished=tuple(self._pending), num_unfinished=self.num_unfinished,
                     num_total=self.num_total, samples=tuple(self._samples), step=self.step,
                     build_state=self._cluster_state)
        self._pending, self._samples = [], []
        return v

    def _cluster_state(self) -> ClusterState:
        reqs = []
        for i, rep in enumerate(self.replicas):
            for r in (*rep.running, *rep.waiting):
                reqs.append(ReqProgress(request_id=r.rid, prompt_key=r.prompt_key, num_prompt_tokens=r.prompt_len,
                                        num_output_tokens=r.g, max_new_tokens=r.max_new, replica=i,
                                        cached=r.cached))
        reqs.sort(key=lambda p: p.request_id)
        return ClusterState(step=self.step, num_devices=self.num_devices, tp=self.tp, requests=tuple(reqs))

    def run(self, stop: Callable[[Sim], bool] | None = None) -> Sim:
        while self.num_unfinished:
            self._advance()
            if not self.num_unfinished:
                break
            action = self.policy.on_poll(self.view())
            if action is not None:
                self.apply(action)
            if stop is not None and stop(self):
                break
        return self

    def applies(self, action: Any) -> bool:
        """Whether `action` can run on the current layout (a Batch skips one that cannot); MixedSim narrows it."""
        return True

    def apply(self, action: Any) -> None:
        handler = self.ACTIONS.get(type(action))
        if handler is None:
            raise ValueError(f"unknown action {action!r}; known {sorted(t.__name__ for t in self.ACTIONS)}")
        handler(self, action)

    # ---- actions -------------------------------------------------------------------------------------------
    def _reconfigure(self, action: Reconfigure) -> None:
        tp = action.tp
        self._check_tp(tp)
        if tp == self.tp:
            return
        t0 = max([self.t, *(rep.t for rep in self.replicas)])
        for rep in self.replicas:
            self.num_preempted += rep.num_preempted
            self.prefill_tokens += rep.prefill_tokens
        reqs = [r for rep in self.replicas for r in rep.export()]
        migrate = [r for r in reqs if r.cached and self._migrates(r, tp)]
        src = self.tp
        cost = self._phase_s(src, tp, sum((r.prompt_len + r.g) * self.hw.kv_bytes_per_token for r in migrate))
        self._base_step = self.step
        self.tp = tp
        self.t = t0 + cost
        self.overhead += cost
        self.replicas = [Replica(self.hw, tp, self.t) for _ in range(self.num_devices // tp)]
        dest = balance([r.prompt_len + r.g for r in reqs], len(self.replicas))  # the Reconfigurer's rule
        mig = {id(r) for r in migrate}
        for r, i in zip(reqs, dest):
            self._place(r, i, id(r) in mig)
        self.schedule.append((t0, tp))
        self._samples.append(ReconfigSample(num_devices=self.num_devices, tp_src=src, tp_dst=tp,
                                            num_tokens=tuple(r.prompt_len + r.g for r in reqs), elapsed_s=cost))
        if action.decision is not None:
            self.decisions.append(action.decision)

    def _place(self, r: SimReq, i: int, migrate: bool) -> bool:
        """Put exported request `r` on replica `i`: with its KV when `migrate` and it fits (True), else queued there
        for re-prefill of prompt + generated tokens."""
        rep = self.replicas[i]
        self.where[r.rid] = i
        r.alloc = 0
        if migrate and rep.import_cached(r):
            return True
        r.cached = False
        rep.waiting.append(r)
        return False

    def _rebalance(self, action: Rebalance) -> None:
        """Each move's request leaves its source replica (`Replica.export`, KV freed there) and joins its
        destination with its KV (`import_cached`) when the hand-off rule says migrate and it fits, else queued
        there for re-prefill of prompt + generated tokens. Same TP, same replicas, no weights move; the pool
        pauses for `_rebalance_s` as for a switch. The driver feeds its planner no measurement of a rebalance
        (driver/switching.py `_apply_rebalance`), so neither does this."""
        n = len(self.replicas)
        for m in action.moves:
            if not (m.src < n and m.dst < n):
                raise ValueError(f"rebalance move {m}: replicas must lie in [0, {n}) at tp={self.tp}")
            if self.where.get(m.request_id) != m.src:
                raise ValueError(f"rebalance move {m}: request {m.request_id!r} is "
                                 + ("not unfinished" if m.request_id not in self.where
                                    else f"on replica {self.where[m.request_id]}, not {m.src}"))
        t0 = max([self.t, *(rep.t for rep in self.replicas)])
        by_src: dict[int, set[str]] = {}
        for m in action.moves:
            by_src.setdefault(m.src, set()).add(m.request_id)
        out = {r.rid: r for src, rids in sorted(by_src.items()) for r in self.replicas[src].export(rids)}
        migrate = {m.request_id for m in action.moves if out[m.request_id].cached
                   and self._migrates(out[m.request_id], self.tp)}
        to_dst: dict[int, float] = {}
        for m in action.moves:
            if m.request_id in migrate:
                r = out[m.request_id]
                to_dst[m.dst] = to_dst.get(m.dst, 0.0) + (r.prompt_len + r.g) * self.hw.kv_bytes_per_token
        cost = self._rebalance_s(to_dst)
        self.t = t0 + cost
        for rep in self.replicas:  # generation paused on every replica, as the driver's loop is
            rep.t = self.t
        for m in sorted(action.moves, key=lambda m: m.request_id):
            self.num_rebalance_migrated += self._place(out[m.request_id], m.dst, m.request_id in migrate)
        self.overhead += cost
        self.rebalance_s += cost
        self.num_rebalances += 1
        self.num_rebalanced += len(action.moves)
        if action.decision is not None:
            self.decisions.append(action.decision)

    def _hindsight_rebalance(self, action: HindsightRebalance) -> None:
        ids, reps, left = [], [], []
        for i, rep in enumerate(self.replicas):
            for r in (*rep.running, *rep.waiting):
                ids.append(r.rid)
                reps.append(i)
                left.append(float(r.length - r.g))  # the truth: hindsight
        moves = plan_moves(ids, reps, left, len(self.replicas))
        if moves:
            self._rebalance(Rebalance(moves=moves))

    def _batch(self, action: Batch) -> None:
        for a in action.actions:
            if self.applies(a):
                self.apply(a)

    def _rebalance_s(self, migrate_bytes: dict[int, float]) -> float:
        """True time of one rebalance: the phases of workers/rebalance.py without reshard or group switch. Plan,
        export, release and import are RPCs (the reconfiguration's fixed_s); the KV hand-off moves each
        destination replica's migrated bytes onto its tp devices, destinations in parallel (latency + the
        largest share / bandwidth). Recomputed requests pay their prefill through admission afterwards."""
        rc = self.hw.reconfig
        cost = rc.fixed_s
        if any(b > 0 for b in migrate_bytes.values()):
            cost += rc.kv_latency_s + max(migrate_bytes.values()) / self.tp / rc.kv_bytes_per_s
        return cost

    def _phase_s(self, src: int, dst: int, migrate_bytes: float, devices: int | None = None) -> float:
        """True time of the phases of one reconfiguration src -> dst moving `migrate_bytes` of KV over `devices`
        devices (default the whole pool; a buddy merge or split passes its block's)."""
        rc = self.hw.reconfig
        w = self.hw.param_bytes
        cost = rc.fixed_s + rc.reshard_fixed_s + max(0.0, w / dst - w / src) / rc.reshard_bytes_per_s + rc.switch_s
        if migrate_bytes > 0:
            cost += rc.kv_latency_s + migrate_bytes / (devices or self.num_devices) / rc.kv_bytes_per_s
        return cost

    def _migrates(self, r: SimReq, tp: int) -> bool:
        """The driver's hand-off rule (kv/cost.py) with the planner's constants; no cost model: recompute."""
        if self.handoff is None:
            return False
        return self.handoff.choose_handoff(r.prompt_len + r.g, self.hw.kv_bytes_per_token, tp).method.is_migrate

    ACTIONS: dict[type, Callable[[Sim, Any], None]] = {Reconfigure: _reconfigure, Rebalance: _rebalance,
                                                       HindsightRebalance: _hindsight_rebalance, Batch: _batch}

    def result(self, name: str) -> SimResult:
        pre = self.num_preempted + sum(rep.num_preempted for rep in self.replicas)
        pf = self.prefill_tokens + sum(rep.prefill_tokens for rep in self.replicas)
        fin = sorted(self.finish_times)
        latency = self.t if self.hw.driver.lockstep else (fin[-1] if fin else 0.0)
        tail = fin[max(0, -(-9 * len(fin) // 10) - 1)] if fin else 0.0
        return SimResult(policy=name, latency_s=latency, schedule=tuple(self.schedule), overhead_s=self.overhead,
                         decisions=tuple(self.decisions), num_preempted=pre, prefill_tokens=pf, tail_start_s=tail,
                         finish_times=tuple(fin), num_rebalances=self.num_rebalances,
                         num_rebalanced=self.num_rebalanced, num_rebalance_migrated=self.num_rebalance_migrated,
                         rebalance_s=self.rebalance_s)

    def clone(self) -> Sim:
        """A deep copy; the truth (hw, its step model and scheduler) and the hand-off rule are shared, and the
        requests are copied field by field first (deepcopy's generic path for them dominated the oracles' time)."""
        memo: dict[int, Any] = {id(o): o for o in (self.hw, self.hw.step, self.hw.scheduler, self.handoff)}
        for rep in self.replicas:
            rep.leave_carry_behind(memo)
            for r in (*rep.running, *rep.waiting, *(r for _, r in rep.finished)):
                memo[id(r)] = SimReq(*_REQ_FIELDS(r))
        return copy.deepcopy(self, memo)
