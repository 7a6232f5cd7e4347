"""#37 item 2: would reclaiming pay? PAT on today's SGLang pool (every layout keeps the TP1 base's weight storage:
TPk holds k x TP1's KV tokens) against PAT on a reclaiming pool (a grow gives the weight memory it frees to the KV
cache, a shrink takes it back: the stock engine's room in every layout), per bench.sim_policies row. SIMULATED.

    python -m pat_rollout.bench.sim_reclaim [--models ...] [--gpus ...] [--variants ...] [--traces ...] [--out F]

A shrink on the reclaiming pool that no longer holds a request's KV: the simulator's hand-off places it without
its KV (`Replica.import_cached` fails) and it is recomputed through admission (re-prefill of prompt + generated
tokens, paid in the stage's time); mapping and unmapping pages is not charged. Each row prints PAT / best static
(statics: a stock engine per layout) for both pools, their ratio, and whether the row is capacity-bound (PAT on
the pool or the best static layout preempts). Decision rule (#37): build reclaiming if reclaiming / pool >= 3% better at the median of
capacity-bound rows or >= 5% on any row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pat_rollout.bench.sim_policies import traces
from pat_rollout.kv.cost import handoff_cost
from pat_rollout.planner.policy import PlannerConfig
from pat_rollout.profile.published import VARIANTS
from pat_rollout.sim.compare import _planners, gpu_setup, pat_hardware
from pat_rollout.sim.policies import PlannerPolicy, StaticPolicy, run_policy


def run_row(model: str, gpu: str, variant: str, name: str, trace, cfg: PlannerConfig) -> dict:
    hw, planner_model = gpu_setup(gpu, model, variant)
    handoff = handoff_cost(planner_model)
    statics = {tp: run_policy(hw, trace, StaticPolicy(tp), num_devices=8) for tp in cfg.candidate_tps}
    best_tp = min(statics, key=lambda tp: statics[tp].latency_s)
    out = {"model": model, "gpu": gpu, "variant": variant, "trace": name, "best_static": f"tp{best_tp}",
           "best_static_s": statics[best_tp].latency_s, "best_static_preempted": statics[best_tp].num_preempted}
    for room in ("pool", "reclaiming"):
        pool = pat_hardware(hw, room)
        planner = _planners(pool, planner_model, cfg, False)["pat"]
        r = run_policy(pool, trace, PlannerPolicy(planner, 1, trace), num_devices=8, handoff=handoff)
        out[f"{room}_s"] = r.latency_s
        out[f"{room}_layouts"] = r.layouts_str()
        out[f"{room}_preempted"] = r.num_preempted
    out["reclaim_vs_pool"] = out["reclaiming_s"] / out["pool_s"]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama31_8b,qwen3_14b")
    ap.add_argument("--gpus", default="h100,h200")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--traces", default="")
    ap.add_argument("--lengths", help="a user's lengths file (the file row)")
    ap.add_argument("--out", help="append each row as JSON to this file")
    args = ap.parse_args(argv)
    cfg = PlannerConfig(candidate_tps=(1, 2, 4, 8))
    trs = traces(args.lengths, 0)
    if args.traces:
        trs = [(n, t) for n, t in trs if n in args.traces.split(",")]
    rows = []
    t0 = time.perf_counter()
    print(f"{'model':<10} {'gpu':<4} {'variant':<7} {'trace':<16} {'best':>4} {'bound':>5} {'pool/best':>9} "
          f"{'recl/best':>9} {'recl/pool':>9}  pool layouts | reclaiming layouts", flush=True)
    for model in args.models.split(","):
        for gpu in args.gpus.split(","):
            for variant in args.variants.split(","):
                for name, trace in trs:
                    r = run_row(model, gpu, variant, name, trace, cfg)
                    rows.append(r)
                    if args.out:
                        with open(args.out, "a") as f:
                            f.write(json.dumps(r) + "\n")
                    best = r["best_static_s"]
                    print(f"{model:<10} {gpu:<4} {variant:<7} {name:<16} {r['best_static']:>4} "
                          f"{'yes' if bound_row(r) else 'no':>5} {r['pool_s'] / best:>9.3f} "
                          f"{r['reclaiming_s'] / best:>9.3f} {r['reclaim_vs_pool']:>9.3f}  {r['pool_layouts']} | "
                          f"{r['reclaiming_layouts']}", flush=True)
    summarize(rows)
    print(f"({len(rows)} rows in {time.perf_counter() - t0:.0f}s)")


def bound_row(r: dict) -> bool:
    """A row where some stage is capacity-bound: PAT on the pool's room or the best static layout preempted."""
    return bool(r["pool_preempted"] or r["best_static_preempted"])


def summarize(rows: list[dict]) -> None:
    if not rows:
        return
    ratio = [r["reclaim_vs_pool"] for r in rows]
    bound = [r["reclaim_vs_pool"] for r in rows if bound_row(r)]
    for label, key in (("PAT pool / best static", "pool_s"), ("PAT reclaiming / best static", "reclaiming_s")):
        xs = [r[key] / r["best_static_s"] for r in rows]
        print(f"{label}: {len(xs)} rows, median {statistics.median(xs):.3f}, worst {max(xs):.3f}, best {min(xs):.3f}")
    med = statistics.median(bound) if bound else 1.0
    print(f"reclaiming / pool: median {statistics.median(ratio):.3f}, best {min(ratio):.3f}; capacity-bound rows "
          f"({len(bound)}): median {med:.3f}")
    build = med <= 0.97 or min(ratio) <= 0.95
    print(f"#37 decision: {'build reclaiming (pays)' if build else 'do not build'} (bar: <= 0.97 median on "
          f"capacity-bound rows or <= 0.95 on any row)")


if __name__ == "__main__":
    main()
