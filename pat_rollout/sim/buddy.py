"""Buddy layouts in the simulator (issue #26): every TP group an aligned power-of-two block of devices; an action
merges two buddy blocks or splits one, and only that block's devices pause for the switch. Pure stdlib.

`MixedSim` is `Sim` plus two actions (`Merge`, `Split`; Sim's `Batch` runs several at one poll, for replayed
schedules, skipping those that no longer apply). Rebalances (`Rebalance`, the oracle's `HindsightRebalance`) run
only while the layout is uniform. While its layout is uniform it is `Sim` itself, line for line (a uniform
`Reconfigure` is Sim's); a whole-pool `Reconfigure` from a mixed layout pays Sim's phases with the largest block as
the source TP (its devices hold the smallest weight share, so they load the most: w / tp_dst - w / largest,
nothing for a grow). Mixed actions need the free-running driver (lockstep=False, SGLang servers): there each replica has its own clock, so the devices outside the regrouped block keep decoding while
the block's replica starts anew at `t0 + its switch time`. A policy reads a mixed layout through the view's
`mixed_state` (planner.mixed.MixedState: blocks and progress, never true lengths); `state` (a ClusterState)
exists only while the layout is uniform. sim/mixed_pat.py drives the mixed planner over it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pat_rollout.planner.balance import balance
from pat_rollout.planner.calibration import ReconfigSample
from pat_rollout.planner.mixed import BuddyDecision, MixedState, buddy_groups, is_buddy
from pat_rollout.planner.state import ClusterState, ReqProgress
from pat_rollout.sim.replica import Replica, SimReq
from pat_rollout.sim.simulator import Batch, HindsightRebalance, PollView, Rebalance, Reconfigure, Sim, SimResult

__all__ = ["Batch", "Merge", "MixedPollView", "MixedResult", "MixedSim", "Split", "buddy_groups", "is_buddy"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Merge:
    """Merge block (start, size) with its buddy (start + size, size) into (start, 2 * size); `start` must be a
    multiple of 2 * size. The two replicas' requests go to the merged group, except `push` ((request id, start
    device of another block): sent there), and so do `pull` (ids of unfinished requests on other replicas). The
    replicas a pulled request leaves or a pushed one joins pause for the hand-off (fixed_s + their KV bytes / tp /
    bandwidth, as a rebalance's do); the rest keep decoding. KV moves by the hand-off rule (kv/cost.py); the other
    requests re-prefill where they land."""

    start: int
    size: int
    pull: tuple[str, ...] = ()
    push: tuple[tuple[str, int], ...] = ()
    decision: BuddyDecision | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Split:
    """Split block (start, size) into its two halves; the block's requests are placed by the Reconfigurer's rule
    (planner.balance.balance on context tokens), the halves having the same TP."""

    start: int
    size: int
    decision: BuddyDecision | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class MixedPollView(PollView):
    """PollView plus the layout's blocks and the planner's view of a buddy layout (`mixed_state`, built on first
    access; `state`, the uniform ClusterState, exists only while the layout is uniform)."""

    blocks: tuple[tuple[int, int], ...] = ()
    build_mixed: Callable[[], MixedState] | None = field(default=None, repr=False, compare=False)
    _mixed: list[MixedState] = field(default_factory=list, repr=False, compare=False)

    @property
    def mixed_state(self) -> MixedState:
        if not self._mixed:
            self._mixed.append(self.build_mixed())  # type: ignore[misc]
        return self._mixed[0]


@dataclass(kw_only=True, slots=True)
class MixedResult(SimResult):
    """SimResult plus the buddy layouts as (time s, block sizes in device order); `schedule` keeps only the
    uniform layouts' entries (tp 0 marks a mixed one)."""

    layouts: tuple[tuple[float, tuple[int, ...]], ...] = ()

    def layouts_str(self) -> str:
        return " -> ".join(("+".join(map(str, sizes))) + f"@{t:.1f}s" for t, sizes in self.layouts)


class MixedSim(Sim):
    """`Sim` over buddy layouts. `blocks[i]` is replica i's (start, size), replicas in device order; `tp` is the
    layout's TP while it is uniform, 0 while it is mixed (no calibration samples are recorded then)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not is_buddy(0, self.num_devices):
            raise ValueError(f"num_devices={self.num_devices} must be a power of two for buddy layouts")
        self.blocks = [(i * self.tp, self.tp) for i in range(len(self.replicas))]
        self.layouts: list[tuple[float, tuple[int, ...]]] = [(self.t, self.sizes())]
        self.num_mixed_actions = 0

    def sizes(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.blocks)

    # ---- uniform path: Sim's ---------------------------------------------------------------------------------
    def _reconfigure(self, action: Any) -> None:
        before = self.sizes()
        Sim._reconfigure(self, action)
        last = self._samples[-1] if self._samples else None
        if isinstance(last, ReconfigSample) and last.tp_src == 0:  # from a mixed layout, priced from its largest
            if max(before) == last.tp_dst:  # block (_phase_s): no (tp_src, tp_dst) pair to calibrate
                self._samples.pop()
            else:
                self._samples[-1] = dataclasses.replace(last, tp_src=max(before))
        self.blocks = [(i * self.tp, self.tp) for i in range(len(self.replicas))]
        if self.sizes() != before:
            self.layouts.append((self.schedule[-1][0], self.sizes()))

    def _phase_s(self, src: int, dst: int, migrate_bytes: float, devices: int | None = None) -> float:
        if src == 0:  # a whole-pool switch from a mixed layout: the largest block's devices load the most weights
            src = max(self.sizes())
        return Sim._phase_s(self, src, dst, migrate_bytes, devices)

    def _record_poll(self, reps: list[Replica], before: dict, elapsed_s: float) -> None:
        if self.tp:
            Sim._record_poll(self, reps, before, elapsed_s)

    def view(self) -> MixedPollView:
        v = Sim.view(self)
        return MixedPollView(**{f.name: getattr(v, f.name) for f in dataclasses.fields(PollView)},
                             blocks=tuple(self.blocks), build_mixed=self.mixed_state)

    def _cluster_state(self) -> ClusterState:
        if not self.tp:
            raise ValueError(f"layout {self.sizes()} is mixed: a ClusterState needs one TP; read the view's "
                             "mixed_state")
        return Sim._cluster_state(self)

    def mixed_state(self) -> MixedState:
        """What the mixed planner sees: the blocks and every unfinished request's progress and block index."""
        reqs = [ReqProgress(request_id=r.rid, prompt_key=r.prompt_key, num_prompt_tokens=r.prompt_len,
                            num_output_tokens=r.g, max_new_tokens=r.max_new, replica=i, cached=r.cached)
                for i, rep in enumerate(self.replicas) for r in (*rep.running, *rep.waiting)]
        reqs.sort(key=lambda p: p.request_id)
        return MixedState(step=self.step, num_devices=self.num_devices, blocks=tuple(self.blocks),
                          requests=tuple(reqs))

    # ---- buddy actions -----------------------------------------------------------------------------------------
    def applies(self, action: Any) -> bool:
        """Whether `action` can run on the current layout (a replayed schedule skips one that cannot)."""
        if isinstance(action, Merge):
            if action.start % (2 * action.size) or (action.start, action.size) not in self.blocks \
                    or (action.start + action.size, action.size) not in self.blocks:
                return False
            here = (self.blocks.index((action.start, action.size)), self.blocks.index((action.start + action.size,
                                                                                       action.size)))
            starts = {s for s, _ in self.blocks} - {action.start, action.start + action.size}
            return (all(self.where.get(rid) not in (None, *here) for rid in action.pull)
                    and all(self.where.get(rid) in here and dst in starts for rid, dst in action.push))
        if isinstance(action, Split):
            return action.size >= 2 and (action.start, action.size) in self.blocks
        if isinstance(action, (Rebalance, HindsightRebalance)):
            return self.tp != 0  # Sim's rebalance pauses and moves at one TP
        return True

    def _index(self, start: int, size: int) -> int:
        try:
            return self.blocks.index((start, size))
        except ValueError:
            raise ValueError(f"no block (start={start}, size={size}) in layout {self.blocks}") from None

    def _at(self, start: int) -> int:
        """Index of the replica whose block starts at device `start`."""
        for k, (s, _) in enumerate(self.blocks):
            if s == start:
                return k
        raise ValueError(f"no block starts at device {start} in layout {self.blocks}")

    def _check_mixed(self) -> None:
        if self.hw.driver.lockstep:
            raise ValueError("buddy merges and splits need the free-running driver (DriverModel.lockstep=False): "
                             "under lockstep every replica waits for the slowest, so no block could keep decoding")

    def _take(self, idx: list[int]) -> tuple[float, list[SimReq]]:
        """Export every request of replicas `idx` (KV freed there); returns (t0, requests), t0 the latest of
        their clocks and the poll time (when the block stops)."""
        t0 = max([self.t, *(self.replicas[i].t for i in idx)])
        reqs = []
        for i in idx:
            rep = self.replicas[i]
            self.num_preempted += rep.num_preempted
            self.prefill_tokens += rep.prefill_tokens
            reqs += rep.export()
        return t0, reqs

    def _bytes(self, reqs: list[SimReq]) -> float:
        return sum((r.prompt_len + r.g) * self.hw.kv_bytes_per_token for r in reqs)

    def _regroup(self, lo: int, hi: int, new: list[tuple[tuple[int, int], Replica]], placed: list[tuple[SimReq, int]],
                 migrate: set[int]) -> None:
        """Replace replicas lo..hi-1 by `new` and place each (request, offset into new)."""
        self.replicas[lo:hi] = [rep for _, rep in new]
        self.blocks[lo:hi] = [b for b, _ in new]
        for r, k in placed:
            self._place(r, lo + k, id(r) in migrate)
        self.where = {r.rid: i for i, rep in enumerate(self.replicas) for r in (*rep.running, *rep.waiting)}
        self.tp = self.blocks[0][1] if len(set(self.sizes())) == 1 else 0
        self._base_step = self.step
        self.num_mixed_actions += 1

    def _merge(self, action: Merge) -> None:
        self._check_mixed()
        if not self.applies(action):
            raise ValueError(f"merge {action}: needs blocks (start={action.start}, size={action.size}) and its buddy "
                             f"above it in layout {self.blocks}, pulls of unfinished requests from elsewhere and "
                             "pushes of the buddies' requests to other blocks")
        i = self._index(action.start, action.size)
        j = self._index(action.start + action.size, action.size)
        tp = 2 * action.size
        rc = self.hw.reconfig
        t0, reqs = self._take([i, j])
        pause: dict[int, float] = {}  # replica outside the block -> KV bytes it sends or receives

        def hand_off_s(rep: Replica, b: float) -> float:  # a rebalance's pause (Sim._rebalance_s) on one replica
            return rc.fixed_s + (rc.kv_latency_s + b / rep.tp / rc.kv_bytes_per_s if b else 0.0)

        by_src: dict[int, set[str]] = {}
        for rid in action.pull:
            by_src.setdefault(self.where[rid], set()).add(rid)
        for k, rids in sorted(by_src.items()):
            out = self.replicas[k].export(rids)
            pause[k] = self._bytes([r for r in out if r.cached and self._migrates(r, tp)])
            reqs += out
        pushed = dict(action.push)
        stay = [r for r in reqs if r.rid not in pushed]
        migrate = [r for r in reqs if r.cached and self._migrates(r, tp if r.rid not in pushed else
                                                                  self.blocks[self._at(pushed[r.rid])][1])]
        cost = self._phase_s(action.size, tp, self._bytes([r for r in migrate if r.rid not in pushed]), tp)
        self.overhead += cost
        out_of_block = [r for r in reqs if r.rid in pushed]
        for r in out_of_block:
            k = self._at(pushed[r.rid])
            pause[k] = pause.get(k, 0.0) + (self._bytes([r]) if r in migrate else 0.0)
        for k, b in pause.items():  # the replicas a pulled request leaves or a pushed one joins pause for it
            rep = self.replicas[k]
            rep.t = max(rep.t, self.t) + hand_off_s(rep, b)
        self._regroup(i, j + 1, [((action.start, tp), Replica(self.hw, tp, t0 + cost))], [(r, 0) for r in stay],
                      {id(r) for r in migrate})
        mig = {id(r) for r in migrate}
        for r in out_of_block:  # indices after the regroup
            self._place(r, self._at(pushed[r.rid]), id(r) in mig)
        self.where = {r.rid: k for k, rep in enumerate(self.replicas) for r in (*rep.running, *rep.waiting)}
        self.layouts.append((t0, self.sizes()))
        if action.decision is not None:
            self.decisions.append(action.decision)

    def _split(self, action: Split) -> None:
        self._check_mixed()
        if action.size < 2:
            raise ValueError(f"split: block (start={action.start}, size={action.size}) is one device")
        i = self._index(action.start, action.size)
        half = action.size // 2
        t0, reqs = self._take([i])
        migrate = [r for r in reqs if r.cached and self._migrates(r, half)]
        cost = self._phase_s(action.size, half, self._bytes(migrate), action.size)
        self.overhead += cost
        dest = balance([r.prompt_len + r.g for r in reqs], 2)  # the Reconfigurer's rule, on the two halves
        new = [((action.start + k * half, half), Replica(self.hw, half, t0 + cost)) for k in range(2)]
        self._regroup(i, i + 1, new, list(zip(reqs, dest)), {id(r) for r in migrate})
        self.layouts.append((t0, self.sizes()))
        if action.decision is not None:
            self.decisions.append(action.decision)

    def _rebalance(self, action: Rebalance) -> None:
        if not self.tp:
            raise ValueError(f"rebalance in mixed layout {self.sizes()}: rebalances run on uniform layouts only")
        Sim._rebalance(self, action)

    ACTIONS: dict[type, Callable[[Sim, Any], None]] = {**Sim.ACTIONS, Reconfigure: _reconfigure, Merge: _merge,
                                                       Split: _split, Rebalance: _rebalance}

    def result(self, name: str) -> MixedResult:
        base = Sim.result(self, name)
        return MixedResult(**{f: getattr(base, f) for f in SimResult.__dataclass_fields__},
                           layouts=tuple(self.layouts))
