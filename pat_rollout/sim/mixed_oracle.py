"""The mixed oracle (issue #26): the best buddy merge/split schedule a bounded search finds in hindsight, beside
the uniform oracle of sim.policies. Pure stdlib."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pat_rollout.kv.cost import HandoffCost
from pat_rollout.planner.mixed import SHARES
from pat_rollout.planner.mixed import longest_moves as planned_moves
from pat_rollout.sim.buddy import Batch, Merge, MixedSim, Split
from pat_rollout.sim.hardware import SimHardware
from pat_rollout.sim.policies import fine_points, oracle_search, schedule_actions
from pat_rollout.sim.simulator import HindsightRebalance, PollView, Reconfigure, SimResult
from pat_rollout.sim.traces import Trace

Entry = tuple[int, Any]  # (unfinished count, action): the action runs at the first poll with at most that many left


@dataclass(slots=True)
class MixedSchedulePolicy:
    """Start at `tp0`; run each entry's action at the first poll with at most its count of requests unfinished
    (entries in order, counts descending; several due at one poll run as one Batch, in order, where a uniform
    switch followed by another keeps only the last, as SwitchPolicy does). An action that no longer applies to the
    layout is skipped (MixedSim.applies)."""

    tp0: int
    entries: tuple[Entry, ...] = ()
    name: str = "mixed-schedule"
    _next: int = field(default=0, init=False)

    def initial_tp(self) -> int:
        return self.tp0

    def on_poll(self, view: PollView) -> Batch | None:
        due = []
        while self._next < len(self.entries) and view.num_unfinished <= self.entries[self._next][0]:
            due.append(self.entries[self._next][1])
            self._next += 1
        due = [a for k, a in enumerate(due) if not (isinstance(a, Reconfigure) and k + 1 < len(due)
                                                   and isinstance(due[k + 1], Reconfigure))]
        return Batch(actions=tuple(due)) if due else None


def longest_moves(sim: MixedSim, start: int, size: int,
                  share: float = 1.0) -> tuple[tuple[str, ...], tuple[tuple[str, int], ...]]:
    """The oracle's "longest to the merged group" (planner.mixed.longest_moves, the mixed planner's rule) on the
    TRUE remaining tokens of every unfinished request: hindsight."""
    items = [(r.rid, k, float(r.length - r.g), r.prompt_len + r.g) for k, rep in enumerate(sim.replicas)
             for r in (*rep.running, *rep.waiting)]
    return planned_moves(sim.blocks, items, start, size, sim.num_devices, share)


def candidates(sim: MixedSim) -> list[Any]:
    """Every buddy action on the current layout: each merge of two buddies (as is; pulling the longest requests
    in; and swapping: the longest in, the buddies' others out, `longest_moves`, for each of SHARES) and each split
    of a block of two or more devices; on a uniform layout also the uniform oracle's rebalance by true lengths
    (HindsightRebalance), so the mixed oracle has every action the uniform one has."""
    out: list[Any] = [HindsightRebalance()] if sim.tp else []
    for start, size in sim.blocks:
        if start % (2 * size) == 0 and (start + size, size) in sim.blocks:
            out.append(Merge(start=start, size=size))
            for share in SHARES:
                pull, push = longest_moves(sim, start, size, share)
                if pull:
                    out.append(Merge(start=start, size=size, pull=pull))
                if push and len(sim.blocks) > 2:
                    out.append(Merge(start=start, size=size, pull=pull, push=push))
        if size >= 2:
            out.append(Split(start=start, size=size))
    return out


def mixed_oracle(hw: SimHardware, trace: Trace, *, num_devices: int, tps: Sequence[int],
                 handoff: HandoffCost | None = None, grid: int = 16, passes: int = 2, beam: int = 2,
                 uniform: tuple[SimResult, int, tuple[tuple[int, int], ...]] | None = None) -> SimResult:
    """The best buddy schedule this search finds in hindsight, simulated on the truth (MixedSim). Never worse
    than the uniform oracle's schedule (`uniform`: sim.policies.oracle_search's answer, switches and rebalances;
    computed with rebalances if not given), which it starts from and returns when nothing beats it.

    Search (branches share their prefix by cloning the simulation):
    - seeds: the uniform oracle's best schedule (its switches and rebalances), and each static start TP in `tps` with no switch;
    - each pass scans up to `beam` schedules (the seeds in the first pass, then the best found not yet scanned):
      run the schedule and, at each point of `fine_points(n, grid)` (unfinished counts, descending), branch on
      every action of `candidates` (each buddy merge as is, pulling the longest requests in, and swapping the
      longest in for the buddies' others; each split) applied
      at that poll, keeping the schedule's later entries (those that no longer apply are skipped), each branch
      run to the end; `passes` passes, so at most `passes` buddy actions are added to a seed (plus its uniform
      switches). Greedy with a bounded width, not exhaustive: not a bound."""
    res_u, tp0, sched = uniform or oracle_search(hw, trace, num_devices=num_devices, tps=tps, handoff=handoff,
                                                 grid=grid, rebalance=True)
    pts = fine_points(len(trace.records), grid)
    found: dict[tuple, tuple[float, SimResult]] = {}
    best: list[tuple[float, SimResult]] = [(res_u.latency_s, res_u)]

    def consider(res: SimResult, key: tuple) -> None:
        found.setdefault(key, (res.latency_s, res))
        if res.latency_s < best[0][0]:
            best[0] = (res.latency_s, res)

    def new_sim(tp: int, entries: tuple[Entry, ...]) -> MixedSim:
        return MixedSim(hw, trace, num_devices=num_devices, policy=MixedSchedulePolicy(tp0=tp, entries=entries),
                        handoff=handoff)

    def scan(tp: int, entries: tuple[Entry, ...]) -> None:
        sim = new_sim(tp, entries)
        for c in pts:
            sim.run(stop=lambda s, c=c: s.num_unfinished <= c)
            if not sim.num_unfinished:
                break
            u = sim.num_unfinished  # the policy has run the entries due at this poll: those with counts >= u
            earlier = tuple(e for e in entries if e[0] >= u)
            later = tuple(e for e in entries if e[0] < u)
            for a in dict.fromkeys(candidates(sim)):  # two shares can pick the same requests: run that once
                branch = sim.clone()
                branch.policy = MixedSchedulePolicy(tp0=tp, entries=later)
                branch.apply(a)
                branch.run()
                consider(branch.result("mixed-oracle"), (tp, (*earlier, (u, a), *later)))
        sim.run()
        consider(sim.result("mixed-oracle"), (tp, entries))

    seed = tuple((c, schedule_actions([(c, t)])[0]) for c, t in sched)  # the uniform schedule as MixedSim entries
    todo = [(tp0, seed)] + [(t, ()) for t in tps]
    scanned: set[tuple] = set()
    for p in range(passes):
        for key in todo[:max(beam, len(todo) if p == 0 else 0)]:
            scanned.add(key)
            scan(*key)
        todo = [k for k, _ in sorted(found.items(), key=lambda kv: kv[1][0]) if k not in scanned][:beam]
        if not todo:
            break
    return dataclasses.replace(best[0][1], policy="mixed-oracle")
