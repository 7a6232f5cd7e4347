"""Simulated stage latency of static TP, PAT and the oracle on the shipped 8-GPU H100 Llama-3.1-8B profile
(published figures, not measurements) over a few seeds of the DeepScaleR-like and verl-like traces.

python -m pat_rollout.bench.sim_policies [--seeds 0,1,2] [--profile h100_llama31_8b]
"""

from __future__ import annotations

import argparse
import time

from pat_rollout.planner.policy import PlannerConfig
from pat_rollout.profile.model import LatencyModel
from pat_rollout.sim.compare import compare, ratios
from pat_rollout.sim.traces import deepscaler_like, verl_like


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--profile", default="h100_llama31_8b")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--num-devices", type=int, default=8)
    args = ap.parse_args(argv)
    model = LatencyModel.from_json(args.profile)
    cfg = PlannerConfig(candidate_tps=(1, 2, 4, 8))
    print(f"profile: {model.meta['model']} on {model.meta['hardware']} [source: {model.meta['source']}]")
    print(f"{'trace':<11} {'seed':>4} {'mean_len':>8} {'best_static':>14} {'pat_s':>8} {'oracle_s':>8} "
          f"{'pat/best':>8} {'orc/best':>8} {'pat/orc':>8} {'pat/tp1':>8} {'pat/tp2':>8}  pat layouts")
    t0 = time.perf_counter()
    for name, make in (("deepscaler", deepscaler_like), ("verl", verl_like)):
        for seed in (int(s) for s in args.seeds.split(",")):
            trace = make(seed=seed)
            res = compare(model, trace, num_devices=args.num_devices, planner_config=cfg, initial_tp=1)
            by = {r.policy: r for r in res}
            best = min((r for r in res if r.policy.startswith("static")), key=lambda r: r.latency_s)
            q = ratios(res)
            print(f"{name:<11} {seed:>4} {trace.stats()['mean']:>8.0f} {best.policy + f' {best.latency_s:.1f}':>14} "
                  f"{by['pat'].latency_s:>8.1f} {by['oracle'].latency_s:>8.1f} {q['pat_vs_best_static']:>8.3f} "
                  f"{q['oracle_vs_best_static']:>8.3f} {q['pat_vs_oracle']:>8.3f} "
                  f"{by['pat'].latency_s / by['static-tp1'].latency_s:>8.3f} "
                  f"{by['pat'].latency_s / by['static-tp2'].latency_s:>8.3f}  {by['pat'].layouts_str()}")
    print(f"(ratios < 1 mean PAT/oracle is faster; simulated in {time.perf_counter() - t0:.1f}s)")


if __name__ == "__main__":
    main()
