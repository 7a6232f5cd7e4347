"""Build the truth and the planner's view for a (profile, trace), run every policy, format the table. Pure stdlib.

The truth of a GPU pool is profile.published.GpuStepModel of the truth variant (exact formula) with the capacity
rule; the planner reads a LatencyModel of the planner variant (default central: it cannot know which end of the
bracket is true) scaled by (1 + planner_error). The planner predicts lengths with the project's predictor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from pat_rollout.kv.cost import handoff_cost
from pat_rollout.planner.engine_spec import EngineSpec
from pat_rollout.planner.policy import Planner, PlannerConfig
from pat_rollout.profile.model import LatencyModel
from pat_rollout.sim.hardware import SimHardware
from pat_rollout.sim.mixed_oracle import mixed_oracle
from pat_rollout.sim.mixed_pat import run_mixed_pat
from pat_rollout.sim.policies import PlannerPolicy, StaticPolicy, oracle_search, run_policy
from pat_rollout.sim.simulator import SimResult
from pat_rollout.sim.traces import Trace

VERL_DEFAULT_TP = 2  # verl's rollout.tensor_model_parallel_size default (also its 7-8B GRPO example scripts)


def scaled(model: LatencyModel, factor: float) -> LatencyModel:
    """The same profile with every decode and prefill time multiplied by `factor` (a planner's model error)."""
    d = model.to_dict()
    for p in d["decode"]:
        p["step_s"] *= factor
    for p in d["prefill"]:
        p["tokens_per_s"] /= factor
        p["fixed_s"] *= factor
    return LatencyModel.from_dict(d)


@dataclass(frozen=True, kw_only=True, slots=True)
class Comparison:
    results: tuple[SimResult, ...]
    verl_tp: int

    def by(self) -> dict[str, SimResult]:
        return {r.policy: r for r in self.results}

    def best_static(self) -> SimResult:
        return min((r for r in self.results if r.policy.startswith("static")), key=lambda r: r.latency_s)

    def ratios(self) -> dict[str, float]:
        by = self.by()
        pat = by["pat"].latency_s
        return {"pat_vs_best_static": pat / self.best_static().latency_s,
                "pat_vs_verl": pat / by[f"static-tp{self.verl_tp}"].latency_s,
                "pat_vs_oracle": pat / by["oracle"].latency_s,
                "oracle_vs_best_static": by["oracle"].latency_s / self.best_static().latency_s}


@dataclass(frozen=True, kw_only=True, slots=True)
class StageRun:
    """compare_stages' outcome: the first and the steady-state (last) stage, and the planners as they ended."""

    first: Comparison
    steady: Comparison
    planners: dict[str, Planner]


ROOMS = ("pool", "reclaiming")


def engine_spec(hw: SimHardware) -> EngineSpec:
    """What the driver reads from its engine: the scheduler's rules and each layout's per-replica KV tokens (pass
    the hardware PAT runs on, `pat_hardware`: the pool's room)."""
    return EngineSpec(scheduler=hw.scheduler, kv_tokens=dict(hw.kv_tokens))


def pat_hardware(hw: SimHardware, room: str = "pool") -> SimHardware:
    """The truth PAT and the oracle run on: "pool", the room pat_rollout's pool has in each layout
    (SimHardware.pool); "reclaiming", a pool that gives the weight memory a grow frees to the KV cache
    (planner.capacity's "sglang-pool-reclaim" rule without granule loss, which is the stock engine's room:
    SimHardware.reclaiming; the loss is < 0.6% of the freed bytes for Llama-3.1-8B, docs/kv_reclaim.md). Static
    layouts run on `hw` itself (a stock engine)."""
    if room == "pool":
        return hw.pool()
    if room == "reclaiming":
        return hw.reclaiming()
    raise ValueError(f"room={room!r} must be one of {ROOMS}")


def room_line(hw: SimHardware) -> str:
    """KV tokens per replica of each layout: the stock engine's (statics) and the pool's (PAT, oracle)."""
    pool = hw.pool().kv_tokens
    return ("KV tokens per replica, stock engine (statics): "
            + ", ".join(f"TP{tp} {n / 1e3:.0f}k" for tp, n in sorted(hw.kv_tokens.items()))
            + "; PAT's pool (PAT, oracle): " + ", ".join(f"TP{tp} {n / 1e3:.0f}k" for tp, n in sorted(pool.items())))


def _tps(planner_config: PlannerConfig, num_devices: int) -> list[int]:
    return sorted(tp for tp in planner_config.candidate_tps if num_devices % tp == 0)


def _planners(hw: SimHardware, planner_model: LatencyModel, planner_config: PlannerConfig,
              with_lookahead: bool) -> dict[str, Planner]:
    """(`hw`: the hardware PAT runs on, whose room the planner is told.)"""
    """The PAT variants by name: "pat" (planner_config as given) and, with_lookahead, "pat-lookahead"."""
    cfgs = {"pat": planner_config}
    if with_lookahead:
        cfgs["pat-lookahead"] = dataclasses.replace(planner_config, estimator="lookahead")
    return {name: Planner(planner_model, cfg, engine=engine_spec(hw)) for name, cfg in cfgs.items()}


def compare(hw: SimHardware, planner_model: LatencyModel, trace: Trace, *, num_devices: int,
            planner_config: PlannerConfig, initial_tp: int = 1, verl_tp: int = VERL_DEFAULT_TP,
            with_oracle: bool = True, with_lookahead: bool = False, mixed: dict | None = None,
            with_mixed_pat: bool = False, room: str = "pool") -> Comparison:
    """static-tp<x> for each candidate tp that divides num_devices, pat (planner_config as given), with_lookahead:
    pat-lookahead (the same config with estimator="lookahead"), and the (switch-only) oracle; `mixed` (keyword
    arguments of sim.mixed_oracle.mixed_oracle, e.g. {} or {"passes": 1}): the uniform oracle with rebalances
    ("oracle-rebalance") and the mixed oracle over buddy layouts, seeded with its schedule; with_mixed_pat:
    "mixed-pat", planner.mixed over buddy layouts on a fresh planner of pat's config with the drain estimator. Statics run on
    `hw` (a stock engine per layout); PAT, its planner's view and the oracles on `pat_hardware(hw, room)`."""
    tps = _tps(planner_config, num_devices)
    handoff = handoff_cost(planner_model)
    pool = pat_hardware(hw, room)
    out = [run_policy(hw, trace, StaticPolicy(tp), num_devices=num_devices) for tp in tps]
    for name, planner in _planners(pool, planner_model, planner_config, with_lookahead).items():
        out.append(run_policy(pool, trace, PlannerPolicy(planner, initial_tp, trace, name=name),
                              num_devices=num_devices, handoff=handoff))
    if with_mixed_pat:
        drain = dataclasses.replace(planner_config, estimator="drain")  # MixedPlanner's estimator
        planner = _planners(pool, planner_model, drain, False)["pat"]
        out.append(run_mixed_pat(pool, trace, planner, num_devices=num_devices, initial_tp=initial_tp,
                                 handoff=handoff))
    if with_oracle:
        out.append(oracle_search(pool, trace, num_devices=num_devices, tps=tps, handoff=handoff)[0])
    if mixed is not None:
        uniform = oracle_search(pool, trace, num_devices=num_devices, tps=tps, handoff=handoff, rebalance=True)
        out.append(uniform[0])
        out.append(mixed_oracle(pool, trace, num_devices=num_devices, tps=tps, handoff=handoff, uniform=uniform,
                                **mixed))
    return Comparison(results=tuple(out), verl_tp=verl_tp)


def compare_stages(hw: SimHardware, planner_model: LatencyModel, stages: list[Trace], *, num_devices: int,
                   planner_config: PlannerConfig, initial_tp: int = 1, with_oracle: bool = True,
                   with_lookahead: bool = False, room: str = "pool",
                   progress: Callable[[str], None] | None = None, oracle_kw: dict | None = None) -> StageRun:
    """Several RL steps of one row: each PAT variant is ONE planner carried across `stages` (its calibration,
    per-prompt history and switch margin carry over, as on a driver). The first stage starts in `initial_tp` (the
    pool's base layout, where the first weights load); each later stage starts in the layout the driver loads the
    new weights in, the planner's `next_start_tp` (the layout it chose to start the previous stage in), so a
    switch at 0 s happens only where the seen batch says so by more than the switch costs. The first stage's
    `history` seeds the predictor, later stages learn from the earlier stages' finished requests. The first and
    the last stage (the steady state) are run with the statics and the oracle too (once where both stages are the
    same batch); stages in between run only the planners. `progress(label)` is called after each run;
    `oracle_kw`: oracle_search's effort (e.g. policies.QUICK_ORACLE)."""
    tps = _tps(planner_config, num_devices)
    handoff = handoff_cost(planner_model)
    pool = pat_hardware(hw, room)
    planners = _planners(pool, planner_model, planner_config, with_lookahead)
    where = dict.fromkeys(planners, initial_tp)
    out: list[Comparison] = []
    fixed: dict[tuple, list[SimResult]] = {}  # statics and oracle of a batch already scored
    note = progress or (lambda label: None)
    for i, trace in enumerate(stages):
        scored = i in (0, len(stages) - 1)
        results: list[SimResult] = []
        key = (trace.records, trace.max_new_tokens)
        if scored and key not in fixed:
            for tp in tps:
                results.append(run_policy(hw, trace, StaticPolicy(tp), num_devices=num_devices))
                note(f"static TP{tp}")
        elif scored:
            results = [r for r in fixed[key] if r.policy.startswith("static")]
        for name, planner in planners.items():
            r = run_policy(pool, trace, PlannerPolicy(planner, where[name], trace if i == 0 else None, name=name),
                           num_devices=num_devices, handoff=handoff)
            nxt = planner.next_start_tp()
            where[name] = nxt if nxt is not None else initial_tp
            results.append(r)
            note(f"{name} stage {i + 1}/{len(stages)}")
        if scored:
            if with_oracle:
                if key in fixed:
                    results.extend(r for r in fixed[key] if r.policy == "oracle")
                else:
                    results.append(oracle_search(pool, trace, num_devices=num_devices, tps=tps, handoff=handoff,
                                                 **(oracle_kw or {}))[0])
                    note("oracle")
            fixed.setdefault(key, results)
            out.append(Comparison(results=tuple(results), verl_tp=VERL_DEFAULT_TP))
    return StageRun(first=out[0], steady=out[-1], planners=planners)


def format_table(cmp: Comparison) -> str:
    """One row per policy: latency, vs best static / verl default / oracle, tail share, preemptions, layouts."""
    by = cmp.by()
    best = cmp.best_static().latency_s
    oracle_s = by["oracle"].latency_s if "oracle" in by else None
    verl = by.get(f"static-tp{cmp.verl_tp}")
    lines = [f"{'policy':<12} {'latency_s':>10} {'vs_best':>8} {'vs_verl':>8} {'vs_orc':>8} {'tail%':>6} "
             f"{'preempt':>7} {'reconf_s':>8}  layouts (TP@start)"]
    for r in cmp.results:
        vo = f"{(r.latency_s / oracle_s - 1) * 100:+.1f}%" if oracle_s else "-"
        vv = f"{(r.latency_s / verl.latency_s - 1) * 100:+.1f}%" if verl else "-"
        lines.append(f"{r.policy:<12} {r.latency_s:>10.2f} {(r.latency_s / best - 1) * 100:>+7.1f}% {vv:>8} "
                     f"{vo:>8} {r.tail_share * 100:>5.1f}% {r.num_preempted:>7} {r.overhead_s:>8.3f}  "
                     f"{r.layouts_str()}")
    return "\n".join(lines)


def summary_line(cmp: Comparison) -> str:
    by = cmp.by()
    pat = by["pat"].latency_s
    best = cmp.best_static()
    out = (f"PAT vs best static ({best.policy}) {pat / best.latency_s:.3f}x, vs verl TP{cmp.verl_tp} "
           f"{pat / by[f'static-tp{cmp.verl_tp}'].latency_s:.3f}x")
    if "oracle" in by:
        out += (f", vs oracle {pat / by['oracle'].latency_s:.3f}x (oracle vs best static "
                f"{by['oracle'].latency_s / best.latency_s:.3f}x)")
    return out


def gpu_setup(gpu: str, model: str, variant: str, *, planner_variant: str = "central", planner_error: float = 0.0,
              mem_fraction: float | None = None) -> tuple[SimHardware, LatencyModel]:
    """The truth (published-figure formula of `variant`) and the planner's profile (`planner_variant`'s builtin
    profile times 1 + planner_error) for one GPU and model."""
    from pat_rollout.profile.published import gpu_step_model, profile_name
    from pat_rollout.sim.hardware import gpu_hardware

    truth_profile = LatencyModel.from_json(profile_name(gpu, model, variant))
    hw = gpu_hardware(truth_profile, gpu_step_model(gpu, model, variant), mem_fraction=mem_fraction)
    planner_model = LatencyModel.from_json(profile_name(gpu, model, planner_variant))
    if planner_error:
        planner_model = scaled(planner_model, 1.0 + planner_error)
    return hw, planner_model
