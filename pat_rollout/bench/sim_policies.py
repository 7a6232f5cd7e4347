"""Simulated stage latency of PAT vs static TP, verl's default TP and the oracle, per model x GPU x TP-cost
variant x trace on 8 GPUs (published-figure profiles: SIMULATED, not measured).

    python -m pat_rollout.bench.sim_policies [--lengths FILE] [--models llama31_8b,qwen3_14b] [--gpus h100,h200]

Traces: DeepScaleR-like at 8k / 16k / 24k caps, verl-like (16k cap), and a user's own lengths file (default: the
shipped example pat_rollout/sim/data/example_lengths.csv, last step). verl's default TP is 2 for both models:
it is verl's rollout.tensor_model_parallel_size default and its 7-8B GRPO examples' setting; verl ships no
Qwen3-14B example, and TP2 leaves KV room at 0.6 x 80 GB for 14B weights. The planner reads the central
variant's profile whatever the truth is. The oracle is the search of sim.policies.oracle (any start, grow and
shrink, up to 3 switches, refined on a fine grid of switch points); a row where PAT beats it is flagged PAT<ORACLE.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from pat_rollout.planner.policy import PlannerConfig
from pat_rollout.profile.published import VARIANTS
from pat_rollout.sim.compare import compare, gpu_setup
from pat_rollout.sim.lengths import read_lengths
from pat_rollout.sim.traces import Trace, deepscaler_like, verl_like

EXAMPLE = Path(__file__).resolve().parents[1] / "sim" / "data" / "example_lengths.csv"


def traces(lengths: str | None, seed: int) -> list[tuple[str, Trace]]:
    out = [(f"deepscaler-{cap // 1024}k", deepscaler_like(max_new_tokens=cap, seed=seed)) for cap in (8192, 16384,
                                                                                                    24576)]
    out.append(("verl-like", verl_like(seed=seed)))
    user = read_lengths(lengths or EXAMPLE)[-1]
    out.append((f"file:{Path(lengths or EXAMPLE).stem}", user))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", help="a user's lengths file (see python -m pat_rollout.sim --help)")
    ap.add_argument("--models", default="llama31_8b,qwen3_14b")
    ap.add_argument("--gpus", default="h100,h200")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--num-devices", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-oracle", action="store_true")
    args = ap.parse_args(argv)
    cfg = PlannerConfig(candidate_tps=(1, 2, 4, 8))
    t_all = time.perf_counter()
    trs = traces(args.lengths, args.seed)
    print("SIMULATED (published-figure profiles, see README 'Performance: measured and simulated'); "
          f"{args.num_devices} GPUs, mem fraction 0.6, GRPO groups of 8; ratios < 1: PAT faster")
    hdr = (f"{'model':<10} {'gpu':<4} {'variant':<7} {'trace':<16} {'mean':>5} {'best static':>13} {'verl tp2':>8} "
           f"{'pat_s':>7} {'oracle':>7} {'pat/best':>8} {'pat/verl':>8} {'pat/orc':>7} {'tail%':>5}  pat layouts")
    pat_orc: list[float] = []
    pat_best: list[float] = []
    for model in args.models.split(","):
        for gpu in args.gpus.split(","):
            print("\n" + hdr)
            for variant in args.variants.split(","):
                hw, planner_model = gpu_setup(gpu, model, variant)
                for name, trace in trs:
                    cmp = compare(hw, planner_model, trace, num_devices=args.num_devices, planner_config=cfg,
                                  with_oracle=not args.no_oracle)
                    by, best, q = cmp.by(), cmp.best_static(), cmp.ratios() if not args.no_oracle else None
                    pat = by["pat"]
                    orc = f"{by['oracle'].latency_s:>7.1f}" if "oracle" in by else f"{'-':>7}"
                    po = f"{q['pat_vs_oracle']:>7.3f}" if q else f"{'-':>7}"
                    verl = by["static-tp2"].latency_s
                    pat_best.append(pat.latency_s / best.latency_s)
                    flag = ""
                    if q:
                        pat_orc.append(q["pat_vs_oracle"])
                        # the oracle is a search, not a bound: a policy below it says the search missed a schedule
                        flag = "  PAT<ORACLE" if q["pat_vs_oracle"] < 1.0 - 1e-9 else ""
                    print(f"{model:<10} {gpu:<4} {variant:<7} {name:<16} {trace.stats()['mean']:>5.0f} "
                          f"{best.policy[7:] + f' {best.latency_s:.1f}':>13} {verl:>8.1f} {pat.latency_s:>7.1f} "
                          f"{orc} {pat.latency_s / best.latency_s:>8.3f} {pat.latency_s / verl:>8.3f} {po} "
                          f"{pat.tail_share * 100:>5.1f}  {pat.layouts_str()}{flag}", flush=True)
    print()
    for label, xs in (("PAT / best static", pat_best), ("PAT / oracle", pat_orc)):
        if xs:
            print(f"{label}: {len(xs)} rows, median {statistics.median(xs):.3f}, worst {max(xs):.3f}, best "
                  f"{min(xs):.3f}, within 2%: {sum(x <= 1.02 for x in xs)}, below 1: {sum(x < 1.0 for x in xs)}")
    print(f"\n(simulated in {time.perf_counter() - t_all:.0f}s; tail% = share of PAT's stage after 90% of responses "
          "finished)")


if __name__ == "__main__":
    main()
