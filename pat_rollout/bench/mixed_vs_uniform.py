"""Issue #26's decision table: the mixed oracle (buddy layouts, sim.mixed_oracle) against the uniform oracle with
switches AND rebalances (sim.policies.oracle_search(rebalance=True)), per model x GPU x TP-cost variant x trace
of bench.sim_policies (published-figure profiles: SIMULATED, not measured). Only the two oracles run (no PAT, no
statics), so every row is affordable; raw results go to JSON lines, one row a line as it finishes, and the table
is re-printed from them without re-running:

    python -m pat_rollout.bench.mixed_vs_uniform --out rows.jsonl [--shard 0/2] [--done other.jsonl ...]
        # run (resumes: skips rows already in --out or in the --done files)
    python -m pat_rollout.bench.mixed_vs_uniform --table rows.jsonl [more.jsonl ...]  # print table + decision

--pat runs mixed PAT (sim.mixed_pat: planner.mixed over buddy layouts) and uniform PAT (the PAT column of
bench.sim_policies: PlannerConfig(candidate_tps=(1, 2, 4, 8)), drain estimator, start TP1, no rebalance: the
SGLang pool) per row instead, seconds a row, into --out; --pat-table prints those rows.

Decision (issue #26): build mixed layouts for real if mixed / uniform <= 0.98 at the median or <= 0.95 on any row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

from pat_rollout.bench.sim_policies import traces
from pat_rollout.kv.cost import handoff_cost
from pat_rollout.planner.policy import Planner, PlannerConfig
from pat_rollout.profile.published import VARIANTS
from pat_rollout.sim.compare import engine_spec, gpu_setup, pat_hardware
from pat_rollout.sim.mixed_oracle import mixed_oracle
from pat_rollout.sim.mixed_pat import run_mixed_pat
from pat_rollout.sim.policies import PlannerPolicy, oracle_search, run_policy

TPS = (1, 2, 4, 8)


def rows(models: str, gpus: str, variants: str, names: str) -> list[tuple[str, str, str, str]]:
    want = set(names.split(",")) if names else None
    trace_names = [n for n, _ in traces(None, 0) if want is None or n in want]
    return [(m, g, v, t) for v in variants.split(",") for m in models.split(",") for g in gpus.split(",")
            for t in trace_names]


def run_row(model: str, gpu: str, variant: str, trace_name: str, *, num_devices: int, seed: int, grid: int,
            passes: int, mixed_passes: int, beam: int, max_rebalances: int) -> dict:
    hw, planner_model = gpu_setup(gpu, model, variant)
    hw = pat_hardware(hw)  # the oracles switch the pool: its room per layout (#37)
    trace = dict(traces(None, seed))[trace_name]
    handoff = handoff_cost(planner_model)
    t0 = time.perf_counter()
    uni = oracle_search(hw, trace, num_devices=num_devices, tps=TPS, handoff=handoff, grid=grid, passes=passes,
                        rebalance=True, max_rebalances=max_rebalances)
    t1 = time.perf_counter()
    mix = mixed_oracle(hw, trace, num_devices=num_devices, tps=TPS, handoff=handoff, grid=grid,
                       passes=mixed_passes, beam=beam, uniform=uni)
    return {"model": model, "gpu": gpu, "variant": variant, "trace": trace_name,
            "uniform_s": uni[0].latency_s, "mixed_s": mix.latency_s, "ratio": mix.latency_s / uni[0].latency_s,
            "uniform_tp0": uni[1], "uniform_schedule": [list(e) for e in uni[2]],
            "uniform_layouts": uni[0].layouts_str(), "uniform_rebalances": uni[0].num_rebalances,
            "mixed_layouts": mix.layouts_str(), "mixed_rebalances": mix.num_rebalances,
            "uniform_search_s": t1 - t0, "mixed_search_s": time.perf_counter() - t1,
            "effort": {"grid": grid, "passes": passes, "mixed_passes": mixed_passes, "beam": beam,
                       "max_rebalances": max_rebalances, "num_devices": num_devices, "seed": seed}}


def run_pat_row(model: str, gpu: str, variant: str, trace_name: str, *, num_devices: int, seed: int,
                **_: object) -> dict:
    """Uniform PAT and mixed PAT on one row, each with a fresh planner (the same configuration)."""
    hw, planner_model = gpu_setup(gpu, model, variant)
    hw = pat_hardware(hw)  # the pool's room per layout (#37)
    trace = dict(traces(None, seed))[trace_name]
    handoff = handoff_cost(planner_model)
    cfg = PlannerConfig(candidate_tps=TPS)
    drain = dataclasses.replace(cfg, estimator="drain")  # MixedPlanner's estimator
    t0 = time.perf_counter()
    uni = run_policy(hw, trace, PlannerPolicy(Planner(planner_model, cfg, engine=engine_spec(hw)), 1, trace),
                     num_devices=num_devices, handoff=handoff)
    t1 = time.perf_counter()
    mix = run_mixed_pat(hw, trace, Planner(planner_model, drain, engine=engine_spec(hw)), num_devices=num_devices,
                        handoff=handoff)
    kinds = [getattr(d, "action", "") for d in mix.decisions]
    return {"model": model, "gpu": gpu, "variant": variant, "trace": trace_name,
            "pat_s": uni.latency_s, "mixed_pat_s": mix.latency_s, "ratio": mix.latency_s / uni.latency_s,
            "pat_layouts": uni.layouts_str(), "mixed_pat_layouts": mix.layouts_str(),
            "mixed_pat_merges": kinds.count("merge"), "mixed_pat_splits": kinds.count("split"),
            "pat_run_s": t1 - t0, "mixed_pat_run_s": time.perf_counter() - t1,
            "effort": {"num_devices": num_devices, "seed": seed, "estimator": cfg.estimator}}


def key(r: dict) -> tuple[str, str, str, str]:
    return r["model"], r["gpu"], r["variant"], r["trace"]


def load(paths: list[str]) -> list[dict]:
    out: dict[tuple, dict] = {}
    for p in paths:
        for line in Path(p).read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                out[key(r)] = r
    return list(out.values())


def decision(xs: list[float]) -> str:
    build = statistics.median(xs) <= 0.98 or min(xs) <= 0.95
    return (f"median {statistics.median(xs):.3f}, best {min(xs):.3f} -> "
            + ("build mixed layouts for real" if build else "do not build (below the 2% median / 5% row bar)"))


def table(results: list[dict], order: list[tuple[str, str, str, str]]) -> str:
    """The per-row table in `order` (missing rows listed), then median/best per variant and overall."""
    by = {key(r): r for r in results}
    lines = [f"{'model':<10} {'gpu':<4} {'variant':<7} {'trace':<22} {'uni+rb':>7} {'mixed':>7} {'mix/uni':>7} "
             f"{'rb':>2}  mixed oracle's layouts"]
    missing = [k for k in order if k not in by]
    for k in order:
        if k in by:
            r = by[k]
            lines.append(f"{k[0]:<10} {k[1]:<4} {k[2]:<7} {k[3]:<22} {r['uniform_s']:>7.1f} {r['mixed_s']:>7.1f} "
                         f"{r['ratio']:>7.3f} {r['uniform_rebalances']:>2}  {r['mixed_layouts']}")
    for v in dict.fromkeys(k[2] for k in order):
        xs = [by[k]["ratio"] for k in order if k in by and k[2] == v]
        if xs:
            lines.append(f"{v}: {len(xs)} rows, {decision(xs)}")
    xs = [by[k]["ratio"] for k in order if k in by]
    if xs:
        lines.append(f"all {len(xs)} of {len(order)} rows: {decision(xs)}")
    if missing:
        lines.append("missing: " + "; ".join("/".join(k) for k in missing))
    return "\n".join(lines)


def pat_table(results: list[dict], order: list[tuple[str, str, str, str]]) -> str:
    """Mixed PAT / uniform PAT per row in `order` (missing rows listed), then median/best/worst per variant and
    overall."""
    by = {key(r): r for r in results}
    lines = [f"{'model':<10} {'gpu':<4} {'variant':<7} {'trace':<22} {'pat':>7} {'mixpat':>7} {'mix/pat':>7} "
             f"{'m':>2} {'s':>2}  mixed PAT's layouts"]
    for k in order:
        if k in by:
            r = by[k]
            lines.append(f"{k[0]:<10} {k[1]:<4} {k[2]:<7} {k[3]:<22} {r['pat_s']:>7.1f} {r['mixed_pat_s']:>7.1f} "
                         f"{r['ratio']:>7.3f} {r['mixed_pat_merges']:>2} {r['mixed_pat_splits']:>2}  "
                         f"{r['mixed_pat_layouts']}")
    for v in [*dict.fromkeys(k[2] for k in order), None]:
        xs = [by[k]["ratio"] for k in order if k in by and v in (None, k[2])]
        if xs:
            lines.append(f"{v or 'all'}: {len(xs)} of {sum(v in (None, k[2]) for k in order)} rows, mixed PAT / "
                         f"PAT median {statistics.median(xs):.3f}, best {min(xs):.3f}, worst {max(xs):.3f}")
    missing = [k for k in order if k not in by]
    if missing:
        lines.append("missing: " + "; ".join("/".join(k) for k in missing))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama31_8b,qwen3_14b")
    ap.add_argument("--gpus", default="h100,h200")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--traces", default="", help="comma-separated trace names (default: all of bench.sim_policies)")
    ap.add_argument("--num-devices", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grid", type=int, default=16, help="both oracles: fine switch points (fine_points)")
    ap.add_argument("--passes", type=int, default=3, help="uniform oracle: refinement passes")
    ap.add_argument("--max-rebalances", type=int, default=2, help="uniform oracle: rebalances per schedule")
    ap.add_argument("--mixed-passes", type=int, default=2, help="mixed oracle: buddy actions added per seed")
    ap.add_argument("--mixed-beam", type=int, default=1, help="mixed oracle: schedules scanned per later pass")
    ap.add_argument("--shard", default="0/1", help="i/k: run rows i, i+k, ... of the list")
    ap.add_argument("--only", default="", help="run these rows first, in this order: model/gpu/variant/trace,...")
    ap.add_argument("--out", help="JSON lines file to append finished rows to (rows already there are skipped)")
    ap.add_argument("--done", nargs="+", default=[], help="also skip the rows in these JSON lines files")
    ap.add_argument("--table", nargs="+", help="print the table from these JSON lines files; run nothing")
    ap.add_argument("--pat", action="store_true", help="run mixed PAT and uniform PAT per row instead of the oracles")
    ap.add_argument("--pat-table", nargs="+", help="print the --pat table from these JSON lines files")
    args = ap.parse_args(argv)
    order = rows(args.models, args.gpus, args.variants, args.traces)
    if args.table or args.pat_table:
        print(table(load(args.table), order) if args.table else pat_table(load(args.pat_table), order))
        return
    i, k = map(int, args.shard.split("/"))
    done = {key(r) for r in load([*args.done, *([args.out] if args.out and Path(args.out).exists() else [])])}
    first = [tuple(x.split("/", 3)) for x in args.only.split(",") if x]
    for row in [*first, *(r for r in order[i::k] if r not in first)]:
        if row in done:
            continue
        r = (run_pat_row if args.pat else run_row)(
            *row, num_devices=args.num_devices, seed=args.seed, grid=args.grid, passes=args.passes,
            mixed_passes=args.mixed_passes, beam=args.mixed_beam, max_rebalances=args.max_rebalances)
        print(json.dumps(r), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
