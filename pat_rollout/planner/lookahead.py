"""The lookahead estimator: the rest of the stage simulated forward with the engine's own mechanics
(planner/engine_model.py, the copy the simulator's truth runs) under each candidate action, on the planner's
calibrated step model, with remaining lengths drawn from the predictor's distribution. Pure stdlib.

What it models, in the order a stage meets it: the driver's dispatch (planner.balance.assign_new, least-inflight)
or, after a regroup, the Reconfigurer's placement (planner.balance.balance on context tokens) with each request's
KV migrated or re-prefilled by the driver's hand-off rule; per-replica KV capacity from the one capacity rule;
admission with the engine's reserve and max_num_seqs; prefill of admitted prompts with GRPO prefix sharing;
preemption with re-prefill; decode steps at the calibrated step time. Replicas run freely (the time to drain is the
last replica's). What it cannot know and so draws: every request's final length.

Speed: the mechanics advance in chunks between finish events, so a replica costs about (requests x distinct finish
steps), and while requests wait, one chunk per `admission_recheck_steps`. Above `LookaheadConfig.units_per_replica`
requests (fewer where a layout has many replicas: `units_per_layout`), a replica's requests are bundled into units
of about m requests with neighbouring drawn lengths (quantile buckets of its draws), each stepped as one request on
the replica scaled by 1/m; drawn lengths round up onto a geometric grid (`length_grid`) so close finishes coincide.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from pat_rollout.planner.balance import assign_new, balance
from pat_rollout.planner.engine_model import EngineReplica, EngineReq, StepModel
from pat_rollout.planner.engine_spec import EngineSpec
from pat_rollout.planner.rebalance import Move, RebalanceCost, RebalanceOption, plan_moves, rebalance_cost
from pat_rollout.planner.state import ReqProgress
from pat_rollout.profile.model import LatencyModel


@dataclass(frozen=True, kw_only=True, slots=True)
class LookaheadConfig:
    """- units_per_replica: above this many requests on a replica, bundle them into about this many units.
    - units_per_layout: at most about this many units over a layout's replicas (a layout of many small replicas
      bundles more: TP1 on 8 devices runs 8 replicas, each costing units x chunks).
    - length_grid: drawn lengths round up to the next point of a geometric grid with this relative step
      (0 = exact); fewer distinct finish steps, fewer chunks.
    - admission_recheck_steps: while requests wait, test admission every this many steps (the engine and the
      simulator: every 16, SchedulerModel.recheck_steps); a request waits up to this many steps too long, and
      a KV-bound layout costs about 16 / this as many chunks."""

    units_per_replica: int = 96
    units_per_layout: int = 768
    length_grid: float = 0.02
    admission_recheck_steps: int = 64

    def __post_init__(self) -> None:
        counts = (self.units_per_replica, self.units_per_layout, self.admission_recheck_steps)
        if self.length_grid < 0 or min(counts) < 1:
            raise ValueError(f"length_grid={self.length_grid} must be >= 0 and units_per_replica, units_per_layout, "
                             f"admission_recheck_steps={counts} >= 1")


def stratified_u(keys: Sequence[str]) -> dict[str, float]:
    """A uniform in [0, 1) per key, stratified over the batch: keys ranked by a hash (stable across polls and
    layouts, so every candidate is scored on the same draws) take (rank + 0.5) / n."""
    order = sorted(keys, key=lambda k: (zlib.crc32(k.encode()), k))
    n = len(order)
    return {k: (i + 0.5) / n for i, k in enumerate(order)}


def round_up_length(n: int, grid: float) -> int:
    """n rounded up to the next point of the geometric grid of relative step `grid` (n itself when 0)."""
    if grid <= 0 or n <= 16:
        return n
    k = math.ceil(math.log(n) / math.log1p(grid) - 1e-9)
    return max(n, int(math.ceil((1.0 + grid) ** k)))


class _Scaled:
    """A step model for units of `m` requests: a batch of b units is b * m requests, a prefill of t unit tokens
    is t * m tokens."""

    def __init__(self, base: StepModel, m: float) -> None:
        self.base, self.m = base, m

    def decode_step_s(self, tp: int, batch: float, context: float) -> float:
        return self.base.decode_step_s(tp, batch * self.m, context)

    def prefill_s(self, tp: int, num_tokens: int) -> float:
        return self.base.prefill_s(tp, round(num_tokens * self.m))


def is_cached(p: ReqProgress) -> bool:
    """Whether p's KV is on its replica: as the engine reported it, else assumed for every started request."""
    return p.cached if p.cached is not None else p.num_output_tokens > 0


@dataclass(kw_only=True, slots=True)
class Lookahead:
    """One poll's lookahead: the requests with their drawn remaining tokens (`remaining[request_id]`), scored
    under any action."""

    step: StepModel
    spec: EngineSpec
    num_devices: int
    requests: Sequence[ReqProgress]
    remaining: Mapping[str, int]
    config: LookaheadConfig = field(default_factory=LookaheadConfig)
    migrates: Callable[[int, int], bool] = field(default=lambda num_tokens, tp: False)  # the hand-off rule
    last_steps: int = 0  # decode steps of the slowest replica in the last action scored (the margin's prediction)

    def replica(self, tp: int, items: Sequence[tuple[ReqProgress, bool]]) -> EngineReplica:
        """A TP=`tp` replica holding `items` in queue order: (request, with its KV here). Its requests beyond
        units_per_replica are bundled into units (see the module docstring); a unit takes its members' mean
        prompt, generated and drawn remaining tokens, holds KV when its median member does, queues where its
        median member would, and shares its prompt's KV with other units only when all its members have that
        prompt (a unit of mixed prompts shares nothing)."""
        n = len(items)
        cfg = self.config
        k = min(n, cfg.units_per_replica, max(1, cfg.units_per_layout * tp // self.num_devices))
        m = n / k if k else 1.0
        s = dataclasses.replace(self.spec.scheduler, recheck_steps=self.config.admission_recheck_steps)
        if m == 1.0:
            rep = EngineReplica(self.step, s, self.spec.capacity(tp), tp)
        else:
            sched = dataclasses.replace(s, max_num_seqs=max(1, int(s.max_num_seqs / m)),
                                        max_prefill_tokens=max(1, int(s.max_prefill_tokens / m)))
            rep = EngineReplica(_Scaled(self.step, m), sched, int(self.spec.capacity(tp) / m), tp)
        grid = self.config.length_grid
        if m == 1.0:
            groups = [[i] for i in range(n)]
        else:
            order = sorted(range(n), key=lambda i: (not items[i][1], items[i][0].num_output_tokens == 0,
                                                    self.remaining[items[i][0].request_id]))
            groups = [sorted(order[j * n // k:(j + 1) * n // k]) for j in range(k)]
            groups.sort(key=lambda grp: grp[len(grp) // 2])  # queue order: never by drawn length
        for grp in groups:
            mid, with_kv = items[grp[len(grp) // 2]]
            ps = [items[i][0] for i in grp]
            g = round(sum(p.num_output_tokens for p in ps) / len(ps))
            rem = math.ceil(sum(self.remaining[p.request_id] for p in ps) / len(ps))
            max_new = max(p.max_new_tokens for p in ps)
            keys = {p.prompt_key for p in ps}
            key = (mid.prompt_key or mid.request_id) if len(keys) == 1 and None not in keys else f"unit:{mid.request_id}"
            r = EngineReq(rid=mid.request_id, prompt_key=key, prompt_len=round(sum(p.num_prompt_tokens for p in ps) / len(ps)),
                          length=min(max_new, round_up_length(g + rem, grid)), max_new=max_new, g=g)
            if not (with_kv and rep.import_cached(r)):
                rep.waiting.append(r)
        return rep

    def _drain(self, reps: list[EngineReplica]) -> float:
        for rep in reps:
            rep.run(1 << 60)
        self.last_steps = max((rep.steps for rep in reps), default=0)
        return max((rep.t for rep in reps), default=0.0)

    def _by_replica(self, num_replicas: int, where: Mapping[str, int],
                    with_kv: Callable[[ReqProgress], bool]) -> list[list[tuple[ReqProgress, bool]]]:
        per: list[list[tuple[ReqProgress, bool]]] = [[] for _ in range(num_replicas)]
        for p in self.requests:
            per[where[p.request_id]].append((p, with_kv(p)))
        for items in per:  # running requests first (their KV is there), then the preempted, then the never started
            items.sort(key=lambda it: (not it[1], it[0].num_output_tokens == 0))
        return per

    def stay_s(self, tp: int) -> float:
        """Seconds to drain in the current layout, each request on its replica (where the state does not say,
        as the driver's dispatch would have put it: least-inflight, in order), with its KV where it is cached
        (a stage not started yet: every request waits, and the time includes every prefill)."""
        n = self.num_devices // tp
        if any(p.replica is None for p in self.requests):
            where = {p.request_id: i for p, i in zip(self.requests, assign_new([0] * n, [1] * len(self.requests)))}
        else:
            where = {p.request_id: int(p.replica) for p in self.requests}  # type: ignore[arg-type]
        return self._drain([self.replica(tp, items) for items in self._by_replica(n, where, is_cached)])

    def regroup_s(self, tp: int) -> tuple[float, list[int]]:
        """Seconds to drain after regrouping to `tp` (not counting the switch's pause), and the context tokens of
        the requests whose KV migrates (the rest re-prefill through admission, as the simulator and engine do).
        A migrated request that does not fit its destination re-prefills too (counted as migrated)."""
        n = self.num_devices // tp
        reqs = sorted(self.requests, key=lambda p: (p.replica or 0, not is_cached(p)))  # export: running first
        dest = balance([p.num_tokens for p in reqs], n)  # the Reconfigurer's rule
        per: list[list[tuple[ReqProgress, bool]]] = [[] for _ in range(n)]
        migrated: list[int] = []
        for p, i in zip(reqs, dest):
            kv = is_cached(p) and self.migrates(p.num_tokens, tp)
            per[i].append((p, kv))
            if kv:
                migrated.append(p.num_tokens)
        return self._drain([self.replica(tp, items) for items in per]), migrated

    def rebalance_s(self, tp: int, moves: Sequence[Move]) -> float:
        """Seconds to drain after `moves` (not counting the pause): movers leave their replica and join their
        destination after its own requests, with their KV when the hand-off rule migrates it, else queued for
        re-prefill."""
        dst = {m.request_id: m.dst for m in moves}
        n = self.num_devices // tp
        per: list[list[tuple[ReqProgress, bool]]] = [[] for _ in range(n)]
        for p in self.requests:
            if p.request_id not in dst:
                per[int(p.replica or 0)].append((p, is_cached(p)))
        for items in per:
            items.sort(key=lambda it: (not it[1], it[0].num_output_tokens == 0))
        for p in sorted((p for p in self.requests if p.request_id in dst), key=lambda p: p.request_id):
            per[dst[p.request_id]].append((p, is_cached(p) and self.migrates(p.num_tokens, tp)))
        return self._drain([self.replica(tp, items) for items in per])

    def rebalance_option(self, tp: int, model: LatencyModel) -> RebalanceOption | None:
        """The moves `plan_moves` proposes for the drawn remaining lengths (every request on a known replica of
        the current layout `tp`), scored by `rebalance_s`; its cost is the pause to migrate the KV the hand-off
        rule moves on `model` (re-prefill is paid inside the lookahead)."""
        reqs = self.requests
        moves = plan_moves([r.request_id for r in reqs], [int(r.replica) for r in reqs],  # type: ignore[arg-type]
                           [self.remaining[r.request_id] for r in reqs], self.num_devices // tp)
        if not moves:
            return None
        remaining_s = self.rebalance_s(tp, moves)
        by_id = {r.request_id: r for r in reqs}
        migrating = tuple(m for m in moves if is_cached(by_id[m.request_id])
                          and self.migrates(by_id[m.request_id].num_tokens, tp))
        kv_s = rebalance_cost(model, tp=tp, moves=migrating, num_tokens={r.request_id: r.num_tokens for r in reqs}).kv_s
        cost = RebalanceCost(kv_s=kv_s, num_migrated=len(migrating), num_recomputed=len(moves) - len(migrating))
        return RebalanceOption(moves=moves, remaining_s=remaining_s, cost=cost)


def build(*, step: StepModel, spec: EngineSpec, num_devices: int, requests: Sequence[ReqProgress],
          draw: Callable[[ReqProgress, float], int], config: LookaheadConfig,
          migrates: Callable[[int, int], bool]) -> Lookahead:
    """Draw every request's remaining tokens: `draw(request, u)`, the predictor's draw at the request's
    stratified quantile u (the same draws score every action)."""
    us = stratified_u([p.request_id for p in requests])
    return Lookahead(step=step, spec=spec, num_devices=num_devices, requests=requests, config=config,
                     remaining={p.request_id: draw(p, us[p.request_id]) for p in requests}, migrates=migrates)
