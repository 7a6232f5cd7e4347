"""Run every policy on one trace and format the comparison table. Pure stdlib."""

from __future__ import annotations

from collections.abc import Sequence

from pat_rollout.planner.policy import Planner, PlannerConfig
from pat_rollout.profile.model import LatencyModel
from pat_rollout.sim.simulator import SimResult, simulate_oracle, simulate_pat, simulate_static
from pat_rollout.sim.traces import Trace


def compare(model: LatencyModel, trace: Trace, *, num_devices: int, planner_config: PlannerConfig,
            initial_tp: int, oracle_max_switches: int = 3) -> list[SimResult]:
    """static-tp<x> for every candidate tp, then pat (starting at initial_tp), then oracle."""
    tps = sorted(tp for tp in planner_config.candidate_tps if num_devices % tp == 0)
    if initial_tp not in tps:
        raise ValueError(f"initial_tp={initial_tp} must be one of the candidate tps {tps} that divide "
                         f"num_devices={num_devices}")
    out = [simulate_static(model, trace, num_devices=num_devices, tp=tp) for tp in tps]
    out.append(simulate_pat(model, trace, num_devices=num_devices, planner=Planner(model, planner_config),
                            initial_tp=initial_tp))
    out.append(simulate_oracle(model, trace, num_devices=num_devices, candidate_tps=tps,
                               max_switches=oracle_max_switches))
    return out


def ratios(results: Sequence[SimResult]) -> dict[str, float]:
    """pat / best static, oracle / best static and pat / oracle latency ratios."""
    by = {r.policy: r.latency_s for r in results}
    best_static = min(v for k, v in by.items() if k.startswith("static"))
    return {"pat_vs_best_static": by["pat"] / best_static, "oracle_vs_best_static": by["oracle"] / best_static,
            "pat_vs_oracle": by["pat"] / by["oracle"]}


def format_table(results: Sequence[SimResult]) -> str:
    """One row per policy: latency, change vs the best static and vs the oracle, reconfigurations, layouts."""
    by = {r.policy: r.latency_s for r in results}
    best_static = min(v for k, v in by.items() if k.startswith("static"))
    oracle = by.get("oracle")
    lines = [f"{'policy':<12} {'latency_s':>10} {'vs_best_static':>15} {'vs_oracle':>10} {'reconfigs':>9} "
             f"{'overhead_s':>10}  layouts (TP@start)"]
    for r in results:
        vs_o = f"{(r.latency_s / oracle - 1) * 100:+.1f}%" if oracle else "-"
        lines.append(f"{r.policy:<12} {r.latency_s:>10.2f} {(r.latency_s / best_static - 1) * 100:>+14.1f}% "
                     f"{vs_o:>10} {r.num_reconfigs:>9} {r.overhead_s:>10.3f}  {r.layouts_str()}")
    return "\n".join(lines)
