"""Policies the simulator runs: static TP, the PAT planner (through the same ClusterState/Decision interface the
driver uses), a fixed schedule, a replay of a real stage's decisions, and the oracle (best schedule in hindsight).
Pure stdlib."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pat_rollout.kv.cost import HandoffCost
from pat_rollout.planner.calibration import ReconfigSample
from pat_rollout.planner.policy import Planner
from pat_rollout.planner.state import ClusterState
from pat_rollout.sim.hardware import SimHardware
from pat_rollout.sim.simulator import Batch, HindsightRebalance, PollView, Rebalance, Reconfigure, Sim, SimResult
from pat_rollout.sim.traces import Trace


@dataclass(slots=True)
class StaticPolicy:
    tp: int
    name: str = ""

    def __post_init__(self) -> None:
        self.name = self.name or f"static-tp{self.tp}"

    def initial_tp(self) -> int:
        return self.tp

    def on_poll(self, view: PollView) -> None:
        return None


class PlannerPolicy:
    """The PAT planner as the driver runs it: it picks the stage's starting layout from where the pool is
    (`Planner.choose_start`; without `start_layout` the pool returns to `initial_tp` first), learns lengths only as
    requests finish (and from `history`, earlier iterations) and calibrates from what the simulated pool measured.
    One planner may serve several stages (one PlannerPolicy each): its calibration carries over, as on a driver.

    `can_rebalance` is the simulated pool's `supports_rebalance`, set on the planner as the driver sets it: False
    models today's SglPool (the planner is never offered a rebalance), True the reference pool's ability (and a
    future SGLang pool's); PlannerConfig.rebalance still decides whether the planner uses it. A rebalance Decision
    becomes a `Rebalance` action with the planner's own moves."""

    def __init__(self, planner: Planner, initial_tp: int, history: Trace | None = None, name: str = "pat", *,
                 can_rebalance: bool = False) -> None:
        self.planner = planner
        planner.can_rebalance = can_rebalance
        self.tp0 = initial_tp
        self.name = name
        planner.start_stage()
        for rec in history.history if history is not None else ():
            planner.observe_history(rec.prompt_id, rec.response_len)

    def initial_tp(self) -> int:
        return self.tp0

    def on_start(self, state: ClusterState) -> Reconfigure | None:
        if not self.planner.config.start_layout:
            return None if state.tp == self.tp0 else Reconfigure(tp=self.tp0)
        d = self.planner.choose_start(state)
        return None if d is None else Reconfigure(tp=d.target_tp, decision=d)

    def observe(self, view: PollView) -> None:
        """Feed the planner what the pool measured and which requests finished since the last poll."""
        for sample in view.samples:
            if isinstance(sample, ReconfigSample):
                self.planner.observe_reconfig(sample)
            else:
                self.planner.observe_poll(sample)
        for key, n in view.finished:
            self.planner.observe_finished(key, n)

    def on_poll(self, view: PollView) -> Reconfigure | Rebalance | None:
        self.observe(view)
        if self.planner.idle(view.step):
            return None  # not due: the state is not built (what decide would answer without reading it)
        d = self.planner.decide(view.state)
        if d is not None and d.is_rebalance:
            return Rebalance(moves=d.moves, decision=d)
        if d is None or d.target_tp == view.state.tp:
            return None
        return Reconfigure(tp=d.target_tp, decision=d)


@dataclass(slots=True)
class ScheduledPolicy:
    """Start at `tp0`; switch to tp when at most `count` requests are unfinished, for each (count, tp)."""

    tp0: int
    switches: tuple[tuple[int, int], ...] = ()
    name: str = "scheduled"

    def initial_tp(self) -> int:
        return self.tp0

    def on_poll(self, view: PollView) -> Reconfigure | Rebalance | None:
        for count, tp in self.switches:
            if view.num_unfinished <= count and tp > view.tp:
                return Reconfigure(tp=tp)
        return None


@dataclass(slots=True)
class ReplayPolicy:
    """The layout decisions a real stage made, by poll: `layouts` is ((polls, tp), ...) as the driver's
    `pat/layout_polls` records them (the layout each began in after that many polls of the stage). Entries at poll
    0 are the stage-start switch; the first is where the pool was. Replaying them separates the performance model
    (what each decision costs and gains) from the planner's choices (which a threshold can flip either way)."""

    layouts: tuple[tuple[int, int], ...]
    name: str = "replay"
    _polls: int = field(default=0, init=False)  # polls of the stage so far
    _next: int = field(default=1, init=False)  # the next entry of `layouts` to apply

    def __post_init__(self) -> None:
        if not self.layouts or self.layouts[0][0] != 0:
            raise ValueError(f"replayed layouts {self.layouts} must start at poll 0")
        if any(b[0] < a[0] for a, b in zip(self.layouts, self.layouts[1:])):
            raise ValueError(f"replayed layouts {self.layouts} are not in poll order")

    @classmethod
    def from_layout_polls(cls, text: str, name: str = "replay") -> ReplayPolicy:
        """Parse the driver's `pat/layout_polls`, e.g. "2xTP1[[0],[1]]@0 -> 1xTP2[[0,1]]@12"."""
        layouts = []
        for part in text.split(" -> "):
            m = re.fullmatch(r"\d+xTP(\d+)(?:\[[\[\],\d]*\])?@(\d+)", part.strip())
            if m is None:
                raise ValueError(f"{part!r} of {text!r} is not a layout by poll (expected e.g. "
                                 f"'2xTP1[[0],[1]]@0 -> 1xTP2[[0,1]]@12', the driver's pat/layout_polls)")
            layouts.append((int(m[2]), int(m[1])))
        return cls(layouts=tuple(layouts), name=name)

    def initial_tp(self) -> int:
        return self.layouts[0][1]

    def on_start(self, state: ClusterState) -> Reconfigure | None:
        self._polls, self._next = 0, 1
        while self._next < len(self.layouts) and self.layouts[self._next][0] == 0:
            self._next += 1
        tp = self.layouts[self._next - 1][1]
        return None if tp == state.tp else Reconfigure(tp=tp)

    def on_poll(self, view: PollView) -> Reconfigure | None:
        self._polls += 1
        tp = None
        while self._next < len(self.layouts) and self.layouts[self._next][0] <= self._polls:
            tp = self.layouts[self._next][1]
            self._next += 1
        return None if tp is None or tp == view.tp else Reconfigure(tp=tp)


REBALANCE = 0  # a schedule entry (count, REBALANCE) is the oracle's HindsightRebalance, not a switch


def schedule_actions(entries: Sequence[tuple[int, int]]) -> list[Reconfigure | HindsightRebalance]:
    """The actions of schedule entries due at one poll, in order; of consecutive switches only the last."""
    acts = [HindsightRebalance() if tp == REBALANCE else Reconfigure(tp=tp) for _, tp in entries]
    return [a for k, a in enumerate(acts) if not (isinstance(a, Reconfigure) and k + 1 < len(acts)
                                                  and isinstance(acts[k + 1], Reconfigure))]


@dataclass(slots=True)
class SwitchPolicy:
    """Start at `tp0`; for each (count, tp) in order, switch to tp (grow or shrink) at the first poll with at
    most `count` requests unfinished (tp REBALANCE: the oracle's rebalance by true lengths instead). The oracle's
    schedules; entries due at one poll run in order (of consecutive switches only the last)."""

    tp0: int
    switches: tuple[tuple[int, int], ...] = ()
    name: str = "schedule"
    _next: int = field(default=0, init=False)

    def initial_tp(self) -> int:
        return self.tp0

    def on_poll(self, view: PollView) -> Reconfigure | HindsightRebalance | Batch | None:
        k = self._next
        while self._next < len(self.switches) and view.num_unfinished <= self.switches[self._next][0]:
            self._next += 1
        acts = schedule_actions(self.switches[k:self._next])
        if len(acts) == 1 and isinstance(acts[0], Reconfigure) and acts[0].tp == view.tp:
            return None
        return None if not acts else acts[0] if len(acts) == 1 else Batch(actions=tuple(acts))


def thresholds(n: int, halvings: int = 8) -> list[int]:
    """Unfinished-request counts at which the oracle's coarse search may switch, descending: n / 2^i for i up to
    `halvings`, and 8, 4, 2, 1."""
    out = {max(1, n >> i) for i in range(1, halvings + 1)} | {8, 4, 2, 1}
    return sorted((x for x in out if x < n), reverse=True)


def fine_points(n: int, grid: int, halvings: int = 8) -> list[int]:
    """The refinement's switch points: unfinished counts n * k / grid for k = grid - 1 .. 1 and the coarse
    thresholds below them, descending."""
    out = {max(1, n * k // grid) for k in range(1, grid)} | set(thresholds(n, halvings))
    return sorted((x for x in out if x < n), reverse=True)


QUICK_ORACLE = {"halvings": 4, "grid": 8, "passes": 1}  # `python -m pat_rollout.sim`: seconds, not minutes


def oracle(hw: SimHardware, trace: Trace, *, num_devices: int, tps: Sequence[int], max_switches: int = 3,
           handoff: HandoffCost | None = None, grid: int = 16, passes: int = 3, rebalance: bool = False,
           max_rebalances: int = 2) -> SimResult:
    """`oracle_search`'s best result."""
    return oracle_search(hw, trace, num_devices=num_devices, tps=tps, max_switches=max_switches, handoff=handoff,
                         grid=grid, passes=passes, rebalance=rebalance, max_rebalances=max_rebalances)[0]


def oracle_search(hw: SimHardware, trace: Trace, *, num_devices: int, tps: Sequence[int], max_switches: int = 3,
                  handoff: HandoffCost | None = None, grid: int = 16, passes: int = 3, rebalance: bool = False,
                  max_rebalances: int = 2, halvings: int = 8) -> tuple[SimResult, int, tuple[tuple[int, int], ...]]:
    """(result, start tp, schedule as SwitchPolicy takes it) of the best uniform schedule this search finds in
    hindsight: simulated on the truth (it knows every length through it). Schedules switch the whole pool at the
    poll where the unfinished count first drops to a point; with `rebalance` they may also rebalance there
    (entry (count, REBALANCE): the simulator's `HindsightRebalance`, i.e. a `Rebalance` with plan_moves' moves for
    the true remaining tokens, at its real cost), at most `max_rebalances` times.

    Search, in two phases (branches share their prefix by cloning the simulation):
    1. exhaustive on the coarse points (`thresholds`: the unfinished count halving): every start TP with every
       increasing TP sequence of at most 2 switches, and every start TP with one action at any coarse point: a
       switch to any other TP (a shrink included) or, with `rebalance`, a rebalance;
    2. greedy refinement of the best schedule on the fine points (`fine_points(n, grid)`): in each pass, try
       inserting at every fine point a switch to every other TP (up to `max_switches` switches) and, with
       `rebalance`, a rebalance (up to `max_rebalances`), the schedule's later entries kept; moving each entry
       to every fine point; and dropping each; keep the best if it improves, up to `passes` passes.
    `rebalance=False` is the switch-only oracle (the PAT columns' baseline: the SGLang pool cannot rebalance).
    `halvings` sets the coarse points (n / 2 .. n / 2^halvings, and 8, 4, 2, 1); the quick search of
    `python -m pat_rollout.sim` (QUICK_ORACLE) uses fewer points, a coarser grid and one pass.
    Not exhaustive, so not a bound: a policy below it is flagged by the benchmark, not hidden."""
    n = len(trace.records)
    thr = thresholds(n, halvings)
    best: list[tuple[float, int, tuple[tuple[int, int], ...], SimResult]] = []
    name = "oracle-rebalance" if rebalance else "oracle"

    def consider(res: SimResult, tp0: int, sched: tuple[tuple[int, int], ...]) -> None:
        if not best or res.latency_s < best[0][0]:
            res.policy = name
            best[:] = [(res.latency_s, tp0, sched, res)]

    def new_sim(tp0: int, sched: tuple[tuple[int, int], ...]) -> Sim:
        return Sim(hw, trace, num_devices=num_devices, policy=SwitchPolicy(tp0=tp0, switches=sched), handoff=handoff)

    def grow(sim: Sim, tp0: int, sched: tuple[tuple[int, int], ...], j0: int, left: int) -> None:
        bigger = [tp for tp in tps if tp > sim.tp]
        for j in range(j0, len(thr)):
            if not left or not bigger:
                break
            c = thr[j]
            sim.run(stop=lambda s, c=c: s.num_unfinished <= c)
            if not sim.num_unfinished:
                break
            for tp in bigger:
                branch = sim.clone()
                branch.apply(Reconfigure(tp=tp))
                grow(branch, tp0, (*sched, (c, tp)), j + 1, left - 1)
        sim.run()
        consider(sim.result(name), tp0, sched)

    def scan(tp0: int, sched: tuple[tuple[int, int], ...], points: Sequence[int], targets: Callable) -> None:
        """Run `sched`; at each point c (descending) branch: switch to each tp in targets(c, tp_now) now (or
        rebalance, tp REBALANCE), then keep the entries of `sched` that come later. Entries are recorded at the
        unfinished count u the poll had (the entries due there ran before the branch's action, in order)."""
        sim = new_sim(tp0, sched)
        for c in points:
            sim.run(stop=lambda s, c=c: s.num_unfinished <= c)
            if not sim.num_unfinished:
                break
            u = sim.num_unfinished if rebalance else c  # the switch-only oracle keeps its original bookkeeping
            later = tuple(x for x in sched if x[0] < u)
            for tp in targets(c, sim.tp):
                if tp == sim.tp:
                    continue
                branch = sim.clone()
                branch.policy = SwitchPolicy(tp0=tp0, switches=later)
                branch.apply(HindsightRebalance() if tp == REBALANCE else Reconfigure(tp=tp))
                branch.run()
                consider(branch.result(name), tp0, (*(x for x in sched if x[0] >= u), (u, tp), *later))
        sim.run()
        consider(sim.result(name), tp0, sched)

    reb = [REBALANCE] if rebalance else []
    for tp in tps:  # phase 1
        grow(new_sim(tp, ()), tp, (), 0, 2)
        scan(tp, (), thr, lambda c, now: [*tps, *reb])
    pts = fine_points(n, grid, halvings)
    for _ in range(passes):  # phase 2
        before = best[0][0]
        _, tp0, sched, _ = best[0]
        n_reb = sum(tp == REBALANCE for _, tp in sched)
        ins = [*(tps if len(sched) - n_reb < max_switches else ()), *(reb if n_reb < max_rebalances else ())]
        if ins:
            scan(tp0, sched, pts, lambda c, now, ins=ins: ins)
        for k, (_, tp_k) in enumerate(sched):
            rest = sched[:k] + sched[k + 1:]
            scan(tp0, rest, pts, lambda c, now, tp_k=tp_k: (tp_k,))
        if best[0][0] >= before:
            break
    return best[0][3], best[0][1], best[0][2]


def run_policy(hw: SimHardware, trace: Trace, policy, *, num_devices: int, handoff: HandoffCost | None = None,
               prev_tp: int | None = None) -> SimResult:
    return Sim(hw, trace, num_devices=num_devices, policy=policy, handoff=handoff,
               prev_tp=prev_tp).run().result(policy.name)
