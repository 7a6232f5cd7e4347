"""Policies the simulator runs: static TP, the PAT planner (through the same ClusterState/Decision interface the
driver uses), a fixed schedule, a replay of a real stage's decisions, and the oracle (best schedule in hindsight).
Pure stdlib."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from pat_rollout.kv.cost import HandoffCost
from pat_rollout.planner.calibration import ReconfigSample
from pat_rollout.planner.policy import Planner
from pat_rollout.planner.state import ClusterState
from pat_rollout.sim.hardware import SimHardware
from pat_rollout.sim.simulator import PollView, Rebalance, Reconfigure, Sim, SimResult
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

    def on_poll(self, view: PollView) -> Reconfigure | Rebalance | None:
        for sample in view.samples:
            if isinstance(sample, ReconfigSample):
                self.planner.observe_reconfig(sample)
            else:
                self.planner.observe_poll(sample)
        for key, n in view.finished:
            self.planner.observe_finished(key, n)
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
            if view.num_unfinished <= count and tp > view.state.tp:
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
        return None if tp is None or tp == view.state.tp else Reconfigure(tp=tp)


def thresholds(n: int) -> list[int]:
    """Unfinished-request counts at which the oracle may switch, descending."""
    out = {max(1, n >> i) for i in range(1, 9)} | {8, 4, 2, 1}
    return sorted((x for x in out if x < n), reverse=True)


def oracle(hw: SimHardware, trace: Trace, *, num_devices: int, tps: Sequence[int], max_switches: int = 2,
           handoff: HandoffCost | None = None) -> SimResult:
    """Best latency over every start TP and every increasing TP sequence of at most `max_switches` switches taken
    when the unfinished count first drops to one of `thresholds`. Simulated on the truth (knows every length
    through it); branches share their prefix by cloning the simulation."""
    thr = thresholds(len(trace.records))
    best: list[SimResult] = []

    def consider(res: SimResult) -> None:
        if not best or res.latency_s < best[0].latency_s:
            best[:] = [res]

    def search(sim: Sim, j0: int, left: int) -> None:
        bigger = [tp for tp in tps if tp > sim.tp]
        base = sim
        for j in range(j0, len(thr)):
            if not left or not bigger:
                break
            n = thr[j]
            base.run(stop=lambda s, n=n: s.num_unfinished <= n)
            if not base.num_unfinished:
                break
            for tp in bigger:
                branch = base.clone()
                branch.apply(Reconfigure(tp=tp))
                search(branch, j + 1, left - 1)
        base.run()
        consider(base.result("oracle"))

    for tp in tps:
        search(Sim(hw, trace, num_devices=num_devices, policy=ScheduledPolicy(tp0=tp), handoff=handoff), 0,
               max_switches)
    return best[0]


def run_policy(hw: SimHardware, trace: Trace, policy, *, num_devices: int, handoff: HandoffCost | None = None,
               prev_tp: int | None = None) -> SimResult:
    return Sim(hw, trace, num_devices=num_devices, policy=policy, handoff=handoff,
               prev_tp=prev_tp).run().result(policy.name)
