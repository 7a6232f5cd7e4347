"""Discrete-event simulation of one synchronous generation stage on `num_devices` devices.

Replicas (TP groups) run independently; a replica's decode-step time comes from the LatencyModel for its current
batch and mean context, integrated in chunks between request completions (as the planner's estimator does).
A reconfiguration stops every replica at the decision time, charges planner.cost.transition_cost (the same
overhead the planner predicts) and redistributes the unfinished requests over the new replicas.

Policies: static(tp); pat(planner) polled every planner.config.eval_every_steps steps through the same
ClusterState/Decision interface a real driver uses (it only learns lengths of requests that finished); oracle,
which knows every length and searches all monotone TP sequences switching at completion events.
Pure stdlib.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pat_rollout.planner.balance import balance
from pat_rollout.planner.cost import transition_cost
from pat_rollout.planner.policy import Planner
from pat_rollout.planner.state import ClusterState, Decision, ReqProgress
from pat_rollout.profile.model import LatencyModel
from pat_rollout.sim.traces import Trace

MAX_CHUNK_STEPS = 256


@dataclass(frozen=True, kw_only=True, slots=True)
class SimResult:
    """Outcome of one policy: stage latency, layouts as (start time s, tp), and reconfiguration overhead paid."""

    policy: str
    latency_s: float
    schedule: tuple[tuple[float, int], ...]
    overhead_s: float
    decisions: tuple[Decision, ...] = ()

    @property
    def num_reconfigs(self) -> int:
        return len(self.schedule) - 1

    def layouts_str(self) -> str:
        return " -> ".join(f"TP{tp}@{t:.1f}s" for t, tp in self.schedule)


@dataclass(frozen=True, slots=True)
class _Req:
    """A request in flight: `g` tokens generated of `length` (its true final length)."""

    rid: str
    prompt_key: str
    prompt_len: int
    length: int
    max_new_tokens: int
    g: int = 0


class _Replica:
    """Timeline of one replica from time t0 with fixed requests: chunk k covers steps [step0[k], step0[k] + n[k])
    starting at start[k], dt[k] seconds per step."""

    def __init__(self, model: LatencyModel, tp: int, reqs: Sequence[_Req], t0: float) -> None:
        items = sorted((r.length - r.g, r.prompt_len + r.g) for r in reqs)
        self.start: list[float] = []
        self.step0: list[int] = []
        self.n: list[int] = []
        self.dt: list[float] = []
        t, done, batch, sum_ctx, k = t0, 0, len(items), sum(x[1] for x in items), 0
        while k < len(items):
            target = items[k][0]
            while done < target:
                n = min(target - done, MAX_CHUNK_STEPS)
                dt = model.decode_step_s(tp, batch, sum_ctx / batch + done + n / 2.0)
                self.start.append(t)
                self.step0.append(done)
                self.n.append(n)
                self.dt.append(dt)
                t += n * dt
                done += n
            while k < len(items) and items[k][0] == target:
                sum_ctx -= items[k][1]
                batch -= 1
                k += 1
        self.t0 = t0
        self.end = t
        self.total_steps = done

    def steps_at(self, t: float) -> int:
        """Steps completed by time t."""
        if t >= self.end:
            return self.total_steps
        k = bisect.bisect_right(self.start, t) - 1
        if k < 0:
            return 0
        return self.step0[k] + min(self.n[k], int(math.floor((t - self.start[k]) / self.dt[k] + 1e-9)))

    def time_of_step(self, s: int) -> float:
        """Time at which step s (1-based count of completed steps) completes; s <= total_steps."""
        if s <= 0:
            return self.t0
        k = bisect.bisect_left(self.step0, s) - 1
        return self.start[k] + (s - self.step0[k]) * self.dt[k]


class _Segment:
    """All replicas of one fixed layout from time t0 until the next reconfiguration (or the end)."""

    def __init__(self, model: LatencyModel, tp: int, num_devices: int, reqs: Sequence[_Req],
                 assignment: Sequence[int], t0: float) -> None:
        self.tp = tp
        self.reqs = list(reqs)
        self.assignment = list(assignment)
        per: list[list[_Req]] = [[] for _ in range(num_devices // tp)]
        for r, a in zip(reqs, assignment):
            per[a].append(r)
        self.replicas = [_Replica(model, tp, rs, t0) for rs in per]
        self.end = max(rep.end for rep in self.replicas)
        finish = [(self.replicas[a].time_of_step(r.length - r.g), i) for i, (r, a) in enumerate(zip(reqs, assignment))]
        self.finish = sorted(finish)

    def time_of_max_step(self, s: int) -> float | None:
        """First time any replica has completed s steps in this segment, or None if none ever does."""
        times = [rep.time_of_step(s) for rep in self.replicas if rep.total_steps >= s]
        return min(times) if times else None

    def max_steps_at(self, t: float) -> int:
        return max(rep.steps_at(t) for rep in self.replicas)

    def advance(self, t: float) -> list[_Req]:
        """Requests with their progress at time t (finished ones dropped), in this segment's order."""
        steps = [rep.steps_at(t) for rep in self.replicas]
        out = []
        for r, a in zip(self.reqs, self.assignment):
            g = r.g + steps[a]
            if g < r.length:
                out.append(_Req(r.rid, r.prompt_key, r.prompt_len, r.length, r.max_new_tokens, g))
        return out


def _requests(trace: Trace) -> list[_Req]:
    return [_Req(f"r{i}", rec.prompt_id, rec.prompt_len, rec.response_len, trace.max_new_tokens)
            for i, rec in enumerate(trace.records)]


def _round_robin(n: int, num_replicas: int) -> list[int]:
    """Stage start: requests arrive in trace order and are spread like verl's least-inflight balancer."""
    return [i % num_replicas for i in range(n)]


def _switch_cost(model: LatencyModel, num_devices: int, tp_src: int, tp_dst: int, reqs: Sequence[_Req]) -> float:
    return transition_cost(model, num_devices=num_devices, tp_src=tp_src, tp_dst=tp_dst,
                           num_tokens=[r.prompt_len + r.g for r in reqs]).total_s


def simulate_static(model: LatencyModel, trace: Trace, *, num_devices: int, tp: int) -> SimResult:
    """Stage latency with a fixed TP=tp layout."""
    reqs = _requests(trace)
    seg = _Segment(model, tp, num_devices, reqs, _round_robin(len(reqs), num_devices // tp), 0.0)
    return SimResult(policy=f"static-tp{tp}", latency_s=seg.end, schedule=((0.0, tp),), overhead_s=0.0)


def simulate_pat(model: LatencyModel, trace: Trace, *, num_devices: int, planner: Planner,
                 initial_tp: int) -> SimResult:
    """Stage latency under the planner, polled every eval_every_steps global decode steps (the most any replica
    has run). The planner sees only finished lengths (in completion order), trace.history and progress counts."""
    k = planner.config.eval_every_steps
    planner.start_stage()
    for rec in trace.history:
        planner.observe_history(rec.prompt_id, rec.response_len)
    reqs = _requests(trace)
    tp, t, base_step, overhead = initial_tp, 0.0, 0, 0.0
    schedule: list[tuple[float, int]] = [(0.0, tp)]
    decisions: list[Decision] = []
    assignment = _round_robin(len(reqs), num_devices // tp)
    while reqs:
        seg = _Segment(model, tp, num_devices, reqs, assignment, t)
        fin = 0
        switched = False
        step = base_step
        while True:
            t_poll = seg.time_of_max_step(step - base_step)
            if t_poll is None:
                break
            while fin < len(seg.finish) and seg.finish[fin][0] <= t_poll:
                r = seg.reqs[seg.finish[fin][1]]
                planner.observe_finished(r.prompt_key, r.length)
                fin += 1
            live = seg.advance(t_poll)
            if live:
                rep_of = dict(zip((r.rid for r in seg.reqs), seg.assignment))
                state = ClusterState(step=step, num_devices=num_devices, tp=tp, requests=tuple(
                    ReqProgress(request_id=r.rid, prompt_key=r.prompt_key, num_prompt_tokens=r.prompt_len,
                                num_output_tokens=r.g, max_new_tokens=r.max_new_tokens, replica=rep_of[r.rid])
                    for r in live))
                d = planner.decide(state)
                if d is not None:
                    pred = planner.predict_remaining(state)
                    cost = _switch_cost(model, num_devices, tp, d.target_tp, live)
                    overhead += cost
                    t = t_poll + cost
                    tp = d.target_tp
                    reqs = live
                    assignment = balance([pred[r.rid] for r in live], num_devices // tp)
                    base_step = step
                    schedule.append((t_poll, tp))
                    decisions.append(d)
                    switched = True
                    break
            step = (step // k + 1) * k
        if not switched:
            for _, i in seg.finish[fin:]:
                planner.observe_finished(seg.reqs[i].prompt_key, seg.reqs[i].length)
            t = seg.end
            reqs = []
    return SimResult(policy="pat", latency_s=t, schedule=tuple(schedule), overhead_s=overhead,
                     decisions=tuple(decisions))


def _thresholds(n: int) -> list[int]:
    """Unfinished-request counts at which the oracle may switch: halvings of n plus small counts, descending."""
    out = {max(1, n >> i) for i in range(1, 16)} | {c for c in (96, 64, 48, 32, 24, 16, 12, 8, 6, 4, 3, 2, 1)}
    return sorted((x for x in out if x < n), reverse=True)


def simulate_oracle(model: LatencyModel, trace: Trace, *, num_devices: int, candidate_tps: Sequence[int],
                    max_switches: int = 3) -> SimResult:
    """Best stage latency over every starting TP and every increasing TP sequence of at most `max_switches`
    switches placed at completion events (when the unfinished count drops to one of `_thresholds`). Knows all
    lengths: rebalances by true remaining length. Charges the same overheads as PAT."""
    tps = sorted(tp for tp in candidate_tps if num_devices % tp == 0)
    thr = _thresholds(len(trace.records))

    def search(t: float, tp: int, reqs: list[_Req], assignment: list[int], j0: int,
               left: int) -> tuple[float, list[tuple[float, int]], float]:
        seg = _Segment(model, tp, num_devices, reqs, assignment, t)
        best = (seg.end, [], 0.0)
        bigger = [x for x in tps if x > tp]
        if not left or not bigger:
            return best
        for j in range(j0, len(thr)):
            n = thr[j]
            if n >= len(reqs):
                continue
            t_sw = seg.finish[len(reqs) - n - 1][0]
            live = seg.advance(t_sw)
            if not live:
                break
            for tp2 in bigger:
                cost = _switch_cost(model, num_devices, tp, tp2, live)
                if t_sw + cost >= best[0]:
                    continue
                asg = balance([r.length - r.g for r in live], num_devices // tp2)
                end, sched, ov = search(t_sw + cost, tp2, live, asg, j + 1, left - 1)
                if end < best[0]:
                    best = (end, [(t_sw, tp2), *sched], ov + cost)
        return best

    results = []
    reqs = _requests(trace)
    for tp in tps:
        end, sched, ov = search(0.0, tp, reqs, _round_robin(len(reqs), num_devices // tp), 0, max_switches)
        results.append((end, tp, sched, ov))
    end, tp, sched, ov = min(results, key=lambda x: (x[0], x[1]))
    return SimResult(policy="oracle", latency_s=end, schedule=((0.0, tp), *sched), overhead_s=ov)
