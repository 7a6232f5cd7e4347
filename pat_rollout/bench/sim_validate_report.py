"""Predicted (simulator) vs measured (reference engine) generation time, side by side. Pure stdlib: reads the
measurements `sim_validate.measure` wrote."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from pat_rollout.bench.sim_validate_configs import CONFIGS, EAGER
from pat_rollout.kv.cost import handoff_cost
from pat_rollout.planner.policy import Planner, PlannerConfig
from pat_rollout.profile.model import BUILTIN_PROFILES, DATA_DIR, LatencyModel
from pat_rollout.sim.hardware import FittedStepModel, SimHardware, ref_cpu_hardware
from pat_rollout.sim.policies import PlannerPolicy, ReplayPolicy, StaticPolicy, run_policy
from pat_rollout.sim.simulator import SimResult
from pat_rollout.sim.traces import Trace, TraceRecord

TOLERANCE = 0.15


def _path(name: str) -> Path:
    if name in BUILTIN_PROFILES:
        return DATA_DIR / BUILTIN_PROFILES[name]
    return Path(name) if Path(name).is_file() else DATA_DIR / f"{name}.json"


def trace_of(spec: list[list[int]], name: str) -> Trace:
    """The batch as a trace: each request's own max_new_tokens is its length (ignore_eos), as the driver sees."""
    recs = tuple(TraceRecord(prompt_id=f"{name}-{i}", prompt_len=p, response_len=n, max_new_tokens=n)
                 for i, (p, n) in enumerate(spec))
    return Trace(name=name, records=recs, max_new_tokens=max(n for _, n in spec))


def predict_sequence(hw: SimHardware, cfg_name: str, policy: str, tp: int, planner_profile: str | None,
                     traces: list[Trace], planner_options: dict) -> list[SimResult]:
    """Simulate the stages one driver runs in order (warm-up first): each stage starts where the previous one
    ended, and the driver returns to the base layout inside the next stage's time, as RolloutDriver does."""
    planner = handoff = None
    if policy == "pat":
        model = LatencyModel.from_json(planner_profile)
        planner = Planner(model, PlannerConfig(candidate_tps=(1, 2), **planner_options))
        handoff = handoff_cost(model)
    out, prev = [], None
    for trace in traces:
        pol = StaticPolicy(tp, name=cfg_name) if planner is None else PlannerPolicy(planner, tp, None, name=cfg_name)
        res = run_policy(hw, trace, pol, num_devices=2, handoff=handoff, prev_tp=prev)
        prev = res.schedule[-1][1]
        out.append(res)
    return out


def predict_replayed(hw: SimHardware, trace: Trace, runs: list[dict], planner_profile: str | None) -> float | None:
    """Median over the measured runs of the simulated time of each run's own layout decisions (`layout_polls`),
    each from the layout that run started in; None when the runs did not record them."""
    handoff = handoff_cost(LatencyModel.from_json(planner_profile)) if planner_profile else None
    times = []
    for run in runs:
        if not run.get("layout_polls"):
            return None
        pol = ReplayPolicy.from_layout_polls(run["layout_polls"])
        times.append(run_policy(hw, trace, pol, num_devices=2, handoff=handoff, prev_tp=pol.initial_tp()).latency_s)
    return statistics.median(times) if times else None


def report(measured: dict, profiles: list[str], poll_overhead_s: float = 0.0,
           concurrency_slowdown: float = 1.0, fitted: bool = True) -> list[float]:
    """Print the table per truth profile; returns every relative error (predicted / measured - 1) of the
    free-running simulation (the simulated planner deciding for itself)."""
    meta = measured["meta"]
    errors = []
    for prof_name in profiles:
        truth = LatencyModel.from_json(prof_name)
        step = FittedStepModel.from_dict(json.loads(Path(_path(prof_name)).read_text())) if fitted else None
        hw = ref_cpu_hardware(truth, tps=(1, 2), num_kv_blocks=meta["num_kv_blocks"], block_size=16,
                              steps_per_poll=meta["steps_per_poll"], poll_overhead_s=poll_overhead_s,
                              concurrency_slowdown=concurrency_slowdown, step=step)
        print(f"\nsimulator truth: profile {prof_name} ({truth.meta['notes'][:48]}...), step model "
              f"{'least-squares fit of its points' if fitted else 'its monotone envelope (as the planner reads it)'}"
              f", poll overhead {poll_overhead_s * 1e3:.1f} ms, concurrency slowdown {concurrency_slowdown:.2f}")
        print(f"{'batch':<30} {'config':<18} {'measured s':>10} {'min-max':>12} {'n':>2} {'predicted s':>11} "
              f"{'error':>7} {'replayed s':>10} {'error':>7}  predicted layouts")
        mine: list[float] = []
        replayed: list[float] = []
        names = list(meta["batches"])
        warm = [[p, n] for p, n in meta["batches"][names[0]][-2:]]
        traces = [trace_of(warm, "warm")] + [trace_of(meta["batches"][b], b[:4]) for b in names]
        preds = {cname: predict_sequence(hw, cname, policy, tp, prof, traces, EAGER if policy == "pat" else {})[1:]
                 for cname, (policy, tp, prof) in CONFIGS.items()}
        for k, bname in enumerate(names):
            for cname in CONFIGS:
                runs = measured["runs"].get(cname, {}).get(bname, [])
                if not runs:
                    continue
                times = [r["seconds"] for r in runs]
                med = statistics.median(times)
                pred = preds[cname][k]
                err = pred.latency_s / med - 1
                mine.append(err)
                rep = predict_replayed(hw, traces[k + 1], runs, CONFIGS[cname][2])
                rep_err = None if rep is None else rep / med - 1
                if rep_err is not None:
                    replayed.append(rep_err)
                flag = "" if abs(err) <= TOLERANCE else "  MISS"
                rep_col = f"{'-':>10} {'-':>7}" if rep is None else f"{rep:>10.2f} {rep_err * 100:>+6.1f}%"
                print(f"{bname:<30} {cname:<18} {med:>10.2f} {min(times):>5.2f}-{max(times):<6.2f} {len(times):>2} "
                      f"{pred.latency_s:>11.2f} {err * 100:>+6.1f}% {rep_col}  {pred.layouts_str()}{flag}")
        inside = sum(abs(e) <= TOLERANCE for e in mine)
        print(f"within +-{TOLERANCE:.0%}: {inside}/{len(mine)} simulating the planner's own decisions (median |error| "
              f"{statistics.median(abs(e) for e in mine) * 100:.1f}%)", end="")
        if replayed:
            print(f"; {sum(abs(e) <= TOLERANCE for e in replayed)}/{len(replayed)} replaying each measured run's "
                  f"decisions (median |error| {statistics.median(abs(e) for e in replayed) * 100:.1f}%)", end="")
        print()
        errors.extend(mine)
    return errors
