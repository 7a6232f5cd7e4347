"""What the simulator treats as the truth of one pool: step times, KV capacity, the engine's scheduler rules, the
driver's poll loop and the reconfiguration's phases. Separate from the profile the planner sees. Pure stdlib."""

from __future__ import annotations

import bisect
import dataclasses
import statistics
from dataclasses import dataclass, field

from pat_rollout.planner.capacity import MemorySpec, block_pool_kv_tokens, pool_kv_tokens, stock_kv_tokens
from pat_rollout.planner.engine_model import SchedulerModel, StepModel
from pat_rollout.profile.model import LatencyModel


@dataclass(frozen=True, kw_only=True, slots=True)
class DriverModel:
    """How generation is driven. lockstep=True is pat_rollout's RolloutDriver: every poll steps each busy replica
    `steps_per_poll` times in parallel and waits for all, plus `poll_overhead_s` (RPC, result handling); the
    planner is asked every poll. lockstep=False: replicas run freely (SGLang servers), the planner is asked every
    `poll_interval_s` of simulated time. `concurrency_slowdown`: factor on step times while more than one
    replica steps at once (replicas sharing CPU cores; 1.0 on GPUs)."""

    lockstep: bool = False
    steps_per_poll: int = 8
    poll_overhead_s: float = 0.0
    poll_interval_s: float = 1.0
    concurrency_slowdown: float = 1.0

    def __post_init__(self) -> None:
        if self.steps_per_poll < 1 or self.poll_overhead_s < 0 or self.poll_interval_s <= 0 \
                or self.concurrency_slowdown < 1:
            raise ValueError(f"steps_per_poll={self.steps_per_poll} >= 1, poll_overhead_s={self.poll_overhead_s} "
                             f">= 0, poll_interval_s={self.poll_interval_s} > 0, concurrency_slowdown="
                             f"{self.concurrency_slowdown} >= 1 required")


@dataclass(frozen=True, kw_only=True, slots=True)
class ReconfigModel:
    """True phases of one reconfiguration (charged serially, generation paused): fixed_s (plan, export, import
    RPCs), reshard fixed_s + moved weight bytes / bandwidth, KV migration of the requests the hand-off rule sends
    (latency + bytes / devices / bandwidth), group switch; recomputed requests re-prefill through admission on
    their new replica afterwards (that cost falls out of the simulation)."""

    fixed_s: float = 0.0
    reshard_fixed_s: float = 0.0
    reshard_bytes_per_s: float = 1e12
    kv_bytes_per_s: float = 1e12
    kv_latency_s: float = 0.0
    switch_s: float = 0.0

    @classmethod
    def from_profile(cls, model: LatencyModel, fixed_s: float = 0.0) -> ReconfigModel:
        return cls(fixed_s=fixed_s, reshard_fixed_s=model.reshard_fixed_s, reshard_bytes_per_s=model.reshard_bandwidth,
                   kv_bytes_per_s=model.kv_bandwidth, kv_latency_s=model.kv_latency_s, switch_s=model.group_switch_s)


@dataclass(frozen=True, kw_only=True, slots=True)
class SimHardware:
    """Everything true about one pool. `kv_tokens[tp]`: KV tokens one TP=tp replica holds in the engine these
    replicas run (a stock engine launched at that TP: the static layouts' truth). `pool_kv_tokens[tp]`: what a
    replica of pat_rollout's pool holds in that layout (planner.capacity: the SGLang pool's base storage
    re-viewed, the reference pool's blocks); None: the same as kv_tokens. `pool()` is this hardware as PAT's
    pool (and the oracle, which switches it) runs it; `reclaiming()` a pool whose grows hand the weight memory
    they free to the KV cache (and shrinks take it back): the stock room in every layout."""

    name: str
    step: StepModel
    param_bytes: int
    kv_bytes_per_token: int
    kv_tokens: dict[int, int]
    scheduler: SchedulerModel = field(default_factory=SchedulerModel)
    driver: DriverModel = field(default_factory=DriverModel)
    reconfig: ReconfigModel = field(default_factory=ReconfigModel)
    pool_kv_tokens: dict[int, int] | None = None

    def pool(self) -> SimHardware:
        """The same pool with the room pat_rollout's pool has in each layout (itself when that is kv_tokens)."""
        if self.pool_kv_tokens is None or self.pool_kv_tokens == self.kv_tokens:
            return self
        return dataclasses.replace(self, name=f"{self.name} (pool room)", kv_tokens=dict(self.pool_kv_tokens),
                                   pool_kv_tokens=None)

    def reclaiming(self) -> SimHardware:
        """PAT's pool if a grow gave the weight memory it frees to the KV cache (and a shrink took it back): the
        stock engine's room in every layout; the switch costs are the same (mapping pages is not charged)."""
        return dataclasses.replace(self, name=f"{self.name} (reclaiming)", pool_kv_tokens=None)

    def capacity(self, tp: int) -> int:
        if tp not in self.kv_tokens:
            raise ValueError(f"{self.name}: no KV capacity for tp={tp}; known {sorted(self.kv_tokens)}")
        return self.kv_tokens[tp]


def gpu_hardware(profile: LatencyModel, step: StepModel, *, tps: tuple[int, ...] = (1, 2, 4, 8),
                 driver: DriverModel | None = None, mem_fraction: float | None = None) -> SimHardware:
    """A GPU pool running SGLang: capacity from the profile's memory section through the shared capacity rule:
    kv_tokens a stock SGLang engine's at each TP, pool_kv_tokens the SGLang pool's (base layout min(tps))."""
    if profile.memory is None:
        raise ValueError(f"profile {profile.meta.get('model')!r} has no memory section: KV capacity is unknown")
    mem = MemorySpec.from_dict(profile.memory)
    if mem_fraction is not None:
        mem = MemorySpec(hbm_bytes=mem.hbm_bytes, mem_fraction=mem_fraction,
                         activation_reserve_bytes=mem.activation_reserve_bytes)
    shape = profile.model
    kw = dict(param_bytes=shape.param_bytes, kv_bytes_per_token=shape.kv_bytes_per_token(),
              num_kv_heads=shape.num_kv_heads, tps=tps)
    return SimHardware(name=f"{profile.meta['hardware']} / {profile.meta['model']}", step=step,
                       param_bytes=shape.param_bytes, kv_bytes_per_token=shape.kv_bytes_per_token(),
                       kv_tokens=stock_kv_tokens(mem, **kw), pool_kv_tokens=pool_kv_tokens(mem, **kw),
                       scheduler=SchedulerModel(kind="sglang", max_num_seqs=1024, max_prefill_tokens=16384,
                                                block_size=1),
                       driver=driver or DriverModel(lockstep=False, poll_interval_s=1.0),
                       reconfig=ReconfigModel.from_profile(profile))


def ref_cpu_hardware(profile: LatencyModel, *, tps: tuple[int, ...], num_kv_blocks: int, block_size: int,
                     steps_per_poll: int, max_num_seqs: int = 256, max_prefill_tokens: int = 2048,
                     poll_overhead_s: float = 0.0, concurrency_slowdown: float = 1.0,
                     step: StepModel | None = None) -> SimHardware:
    """The reference engine on the CPU pool under RolloutDriver, with a profile measured there as the truth.
    num_kv_blocks is per rank and every rank holds its share of the heads: a replica holds the same number of
    tokens at every TP (the capacity rule with the engine's fixed block pool)."""
    shape = profile.model
    return SimHardware(name=f"{profile.meta['hardware']} / {profile.meta['model']}", step=step or profile,
                       param_bytes=shape.param_bytes, kv_bytes_per_token=shape.kv_bytes_per_token(),
                       kv_tokens=block_pool_kv_tokens(num_kv_blocks=num_kv_blocks, block_size=block_size, tps=tps),
                       scheduler=SchedulerModel(kind="ref", max_num_seqs=max_num_seqs,
                                                max_prefill_tokens=max_prefill_tokens, block_size=block_size),
                       driver=DriverModel(lockstep=True, steps_per_poll=steps_per_poll, poll_overhead_s=poll_overhead_s,
                                          concurrency_slowdown=concurrency_slowdown),
                       reconfig=ReconfigModel.from_profile(profile))


class FittedStepModel:
    """True step times of a measured pool, robust to single bad profile points: per TP size,
    step_s(batch, context) = f(batch) + k * batch * context, with k the median over batch rows of each row's
    least-squares slope in batch * context (>= 0), and f at each profiled batch the median over that row's points
    of step_s - k * batch * context, linear between profiled batches (and beyond, with the last segment's slope).
    Point values are the `step_s_range` minimum where the profiler recorded one (the least disturbed repeat).
    A profile point is one noisy measurement; the LatencyModel the planner reads takes a monotone envelope of the
    points, which turns one slow point (a layout's first, cold measurement) into a floor for every larger load.
    Prefill is the profile's own linear entry."""

    def __init__(self, points: dict[int, list[tuple[int, int, float]]], profile: LatencyModel) -> None:
        self.rows: dict[int, tuple[list[int], list[float], float]] = {}
        for tp, pts in points.items():
            by_batch: dict[int, list[tuple[float, float]]] = {}
            for b, c, st in pts:
                by_batch.setdefault(b, []).append((float(b * c), st))
            slopes = []
            for xs in by_batch.values():
                if len(xs) > 1:
                    mx = sum(x for x, _ in xs) / len(xs)
                    my = sum(y for _, y in xs) / len(xs)
                    den = sum((x - mx) ** 2 for x, _ in xs)
                    slopes.append(max(0.0, sum((x - mx) * (y - my) for x, y in xs) / den) if den else 0.0)
            k = statistics.median(slopes) if slopes else 0.0
            bs = sorted(by_batch)
            self.rows[tp] = (bs, [statistics.median(y - k * x for x, y in by_batch[b]) for b in bs], k)
        self.profile = profile

    @classmethod
    def from_dict(cls, d: dict) -> FittedStepModel:
        pts: dict[int, list[tuple[int, int, float]]] = {}
        for p in d["decode"]:
            s = min(p["step_s_range"]) if p.get("step_s_range") else p["step_s"]
            pts.setdefault(int(p["tp"]), []).append((int(p["batch"]), int(p["context"]), float(s)))
        return cls(pts, LatencyModel.from_dict(d))

    def decode_step_s(self, tp: int, batch: float, context: float) -> float:
        if batch <= 0:
            return 0.0
        bs, f, k = self.rows[tp]
        if len(bs) == 1 or batch <= bs[0]:
            base = f[0]
        else:
            i = min(bisect.bisect_right(bs, batch) - 1, len(bs) - 2)
            base = f[i] + (batch - bs[i]) * (f[i + 1] - f[i]) / (bs[i + 1] - bs[i])
        return max(base, 1e-9) + k * batch * context

    def prefill_s(self, tp: int, num_tokens: int) -> float:
        return self.profile.prefill_s(tp, num_tokens)
