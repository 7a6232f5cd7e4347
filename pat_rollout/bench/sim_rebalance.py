"""Simulated gain of rebalancing across replicas: alone, with regrouping, and against the regroup-only oracle, per
model x GPU x TP-cost variant x trace on 8 GPUs (published-figure profiles: SIMULATED, not measured).

    python -m pat_rollout.bench.sim_rebalance [--quick] [--models ...] [--gpus ...] [--variants ...] [--traces ...]

Per row: the best static layout; PAT regroup-only (the planner of bench/sim_policies, rebalance off); PAT
rebalance-only (candidate_tps = the best static TP alone, so it starts there and can only rebalance); PAT with
both; the oracle (best regroup schedule in hindsight, no rebalance). The simulated pool can rebalance
(`PlannerPolicy(can_rebalance=True)`: the reference pool's ability, and a future SGLang pool's; today's SglPool
cannot). The planner reads the central variant's profile whatever the truth is; traces as bench/sim_policies.
"""

from __future__ import annotations

import argparse
import statistics
import time

from pat_rollout.bench.sim_policies import traces
from pat_rollout.kv.cost import handoff_cost
from pat_rollout.planner.policy import Planner, PlannerConfig
from pat_rollout.profile.model import LatencyModel
from pat_rollout.profile.published import VARIANTS
from pat_rollout.sim.compare import compare, gpu_setup
from pat_rollout.sim.hardware import SimHardware
from pat_rollout.sim.policies import PlannerPolicy, run_policy
from pat_rollout.sim.simulator import SimResult
from pat_rollout.sim.traces import Trace

CANDIDATE_TPS = (1, 2, 4, 8)
QUICK = {"models": "llama31_8b", "gpus": "h100", "traces": "deepscaler-16k,verl-like"}


def pat_run(hw: SimHardware, planner_model: LatencyModel, trace: Trace, *, num_devices: int, tps: tuple[int, ...],
            rebalance: bool) -> SimResult:
    """PAT on a pool that can rebalance; `rebalance` is the planner's PlannerConfig.rebalance."""
    planner = Planner(planner_model, PlannerConfig(candidate_tps=tps, rebalance=rebalance))
    return run_policy(hw, trace, PlannerPolicy(planner, tps[0], trace, can_rebalance=True),
                      num_devices=num_devices, handoff=handoff_cost(planner_model))


def row(hw: SimHardware, planner_model: LatencyModel, trace: Trace, *, num_devices: int) -> dict[str, SimResult]:
    """best static, regroup-only (as bench/sim_policies' pat), rebalance-only, both, oracle."""
    cmp = compare(hw, planner_model, trace, num_devices=num_devices,
                  planner_config=PlannerConfig(candidate_tps=CANDIDATE_TPS))
    by, best = cmp.by(), cmp.best_static()
    return {"static": best, "regroup": by["pat"], "oracle": by["oracle"],
            "rebalance": pat_run(hw, planner_model, trace, num_devices=num_devices,
                                 tps=(int(best.policy[len("static-tp"):]),), rebalance=True),
            "both": pat_run(hw, planner_model, trace, num_devices=num_devices, tps=CANDIDATE_TPS, rebalance=True)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"only {QUICK} (all variants)")
    ap.add_argument("--lengths", help="a user's lengths file (see python -m pat_rollout.sim --help)")
    ap.add_argument("--models", default="llama31_8b,qwen3_14b")
    ap.add_argument("--gpus", default="h100,h200")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--traces", default="", help="comma-separated trace names (default: every trace)")
    ap.add_argument("--num-devices", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    t_all = time.perf_counter()
    trs = traces(args.lengths, args.seed)
    if args.traces:
        want = args.traces.split(",")
        if unknown := sorted(set(want) - {n for n, _ in trs}):
            raise SystemExit(f"unknown traces {unknown}; known {[n for n, _ in trs]}")
        trs = [(n, t) for n, t in trs if n in want]
    print("SIMULATED (published-figure profiles, see README 'Performance: measured and simulated'); "
          f"{args.num_devices} GPUs, mem fraction 0.6, GRPO groups of 8; seconds; ratios < 1: the first is faster; "
          "rb = rebalances (requests moved)")
    hdr = (f"{'model':<10} {'gpu':<4} {'variant':<7} {'trace':<16} {'best static':>13} {'regroup':>7} "
           f"{'rebal':>7} {'both':>7} {'oracle':>7} {'rebal/best':>10} {'both/regr':>9} {'both/orc':>8} "
           f"{'rb(moved) rebal':>15} {'both':>9}  both layouts")
    ratios: list[tuple[float, float, float]] = []
    for model in args.models.split(","):
        for gpu in args.gpus.split(","):
            print("\n" + hdr)
            for variant in args.variants.split(","):
                hw, planner_model = gpu_setup(gpu, model, variant)
                for name, trace in trs:
                    r = row(hw, planner_model, trace, num_devices=args.num_devices)
                    s = {k: v.latency_s for k, v in r.items()}
                    q = (s["rebalance"] / s["static"], s["both"] / s["regroup"], s["both"] / s["oracle"])
                    ratios.append(q)
                    rb = f"{r['rebalance'].num_rebalances}({r['rebalance'].num_rebalanced})"
                    bo = f"{r['both'].num_rebalances}({r['both'].num_rebalanced})"
                    best = f"{r['static'].policy[7:]} {s['static']:.1f}"
                    print(f"{model:<10} {gpu:<4} {variant:<7} {name:<16} {best:>13} {s['regroup']:>7.1f} "
                          f"{s['rebalance']:>7.1f} {s['both']:>7.1f} {s['oracle']:>7.1f} {q[0]:>10.3f} "
                          f"{q[1]:>9.3f} {q[2]:>8.3f} {rb:>15} {bo:>9}  {r['both'].layouts_str()}", flush=True)
    if ratios:
        cols = list(zip(*ratios))
        print("\nover the rows: " + "; ".join(
            f"{name} min {min(c):.3f} / median {statistics.median(c):.3f} / max {max(c):.3f}"
            for name, c in zip(("rebal/best", "both/regr", "both/orc"), cols)))
    print(f"(simulated in {time.perf_counter() - t_all:.0f}s)")


if __name__ == "__main__":
    main()
