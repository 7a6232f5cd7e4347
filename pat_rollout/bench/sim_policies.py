"""Simulated stage latency of PAT vs static TP, verl's default TP and the oracle, per model x GPU x TP-cost
variant x trace on 8 GPUs (published-figure profiles: SIMULATED, not measured).

    python -m pat_rollout.bench.sim_policies [--lengths FILE] [--models llama31_8b,qwen3_14b] [--gpus h100,h200]

Traces: DeepScaleR-like at 8k / 16k / 24k caps, verl-like (16k cap), and a user's own lengths file (default: the
shipped example pat_rollout/sim/data/example_lengths.csv, last step). verl's default TP is 2 for both models:
it is verl's rollout.tensor_model_parallel_size default and its 7-8B GRPO examples' setting; verl ships no
Qwen3-14B example, and TP2 leaves KV room at 0.6 x 80 GB for 14B weights. The planner reads the central
variant's profile whatever the truth is. The oracle is the search of sim.policies.oracle (any start, grow and
shrink, up to 3 switches, refined on a fine grid of switch points); a row where PAT beats it is flagged PAT<ORACLE.
PAT is the planner as configured by default (PlannerConfig.estimator="drain"); the "la" columns run the same
planner with estimator="lookahead" (--no-lookahead skips them), flagged LA<ORACLE where it beats the oracle.
--stages N (issue #24): N RL steps per row (deepscaler/verl: fresh draws of the same prompts; a file: its last
step repeated), each PAT a single planner carried across them (calibration, per-prompt history, switch margin);
prints the first and the steady-state (last) stage of each row and their summaries.
--mixed adds the mixed oracle over buddy layouts (sim.mixed_oracle, issue #26: merge/split of aligned
power-of-two blocks, only the regrouped block pausing) beside the uniform oracle with rebalances (its seed), and
issue #26's decision: build mixed layouts for real if mixed / uniform-with-rebalance oracle <= 0.98 at the median
or <= 0.95 on any row (bench.mixed_vs_uniform runs just those two oracles, cheaper, to JSON).
--mixed-pat adds mixed PAT (sim.mixed_pat: planner.mixed's merges and splits over buddy layouts, on a planner of
PAT's configuration) and its ratio to PAT (bench.mixed_vs_uniform --pat runs just those two, to JSON).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from pat_rollout.planner.policy import PlannerConfig
from pat_rollout.profile.published import VARIANTS
from pat_rollout.sim.compare import ROOMS, Comparison, compare, compare_stages, gpu_setup, room_line
from pat_rollout.sim.lengths import read_lengths
from pat_rollout.sim.policies import QUICK_ORACLE
from pat_rollout.sim.traces import Trace, deepscaler_like, rl_stages, verl_like

EXAMPLE = Path(__file__).resolve().parents[1] / "sim" / "data" / "example_lengths.csv"


def traces(lengths: str | None, seed: int, history_iters: int = 1) -> list[tuple[str, Trace]]:
    """The rows' traces; history_iters earlier draws of each synthetic batch (its records do not change)."""
    out = [(f"deepscaler-{cap // 1024}k", deepscaler_like(max_new_tokens=cap, seed=seed, history_iters=history_iters))
           for cap in (8192, 16384, 24576)]
    out.append(("verl-like", verl_like(seed=seed, history_iters=history_iters)))
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
    ap.add_argument("--no-lookahead", action="store_true", help="skip the PAT lookahead columns")
    ap.add_argument("--mixed", action="store_true", help="add the mixed (buddy layout) oracle column (slow)")
    ap.add_argument("--mixed-pat", action="store_true", help="add the mixed PAT (buddy layout planner) column")
    ap.add_argument("--mixed-passes", type=int, default=2, help="mixed oracle: buddy actions added per seed")
    ap.add_argument("--mixed-beam", type=int, default=1, help="mixed oracle: schedules scanned per later pass")
    ap.add_argument("--traces", default="", help="comma-separated trace names to run (default: all)")
    ap.add_argument("--stages", type=int, default=1, help="RL steps per row, one planner carried across them")
    ap.add_argument("--quick-oracle", action="store_true",
                    help="with --stages: the oracle's quick search (sim.policies.QUICK_ORACLE), as sim --lengths")
    ap.add_argument("--room", default="pool", choices=ROOMS,
                    help="KV room of PAT's pool: pool (today's SGLang pool: its TP1 storage re-viewed) or "
                         "reclaiming (a grow gives freed weight memory to the KV cache: the stock room)")
    args = ap.parse_args(argv)
    cfg = PlannerConfig(candidate_tps=(1, 2, 4, 8))
    t_all = time.perf_counter()
    trs = traces(args.lengths, args.seed, history_iters=max(1, args.stages))
    if args.stages > 1 and (args.mixed or args.mixed_pat):
        ap.error("--mixed and --mixed-pat run one stage per row")
    if args.traces:
        trs = [(n, t) for n, t in trs if n in args.traces.split(",")]
    mixed = {"passes": args.mixed_passes, "beam": args.mixed_beam} if args.mixed else None
    print("SIMULATED (published-figure profiles, see README 'Performance: measured and simulated'); "
          f"{args.num_devices} GPUs, mem fraction 0.6, GRPO groups of 8; ratios < 1: PAT faster")
    la, mpat = not args.no_lookahead, args.mixed_pat
    hdr = (f"{'model':<10} {'gpu':<4} {'variant':<7} {'trace':<16} {'mean':>5} {'best static':>13} {'verl tp2':>8} "
           f"{'pat_s':>7} {'oracle':>7} {'pat/best':>8} {'pat/verl':>8} {'pat/orc':>7} {'tail%':>5}"
           + (f" {'la/best':>7} {'la/orc':>7}" if la else "") + (f" {'mixed':>7} {'mix/orc':>7}" if mixed else "")
           + (f" {'mpat':>7} {'mpat/pat':>8}" if mpat else "")
           + "  pat layouts" + (" | la layouts" if la else "") + (" | mixed layouts" if mixed else "")
           + (" | mixed pat layouts" if mpat else ""))
    tags = ("",) if args.stages <= 1 else ("first ", "steady ")
    ratios: dict[str, list[float]] = {t + k: [] for t in tags for k in (
        "PAT / best static", "PAT / oracle", "PAT lookahead / best static", "PAT lookahead / oracle",
        "Mixed oracle / uniform oracle", "Mixed PAT / PAT")}
    for model in args.models.split(","):
        for gpu in args.gpus.split(","):
            hw, _ = gpu_setup(gpu, model, VARIANTS[0])
            print(f"\n{model} {gpu}: {room_line(hw)}; PAT runs on: {args.room}\n" + hdr)
            for variant in args.variants.split(","):
                hw, planner_model = gpu_setup(gpu, model, variant)
                for name, trace in trs:
                    if args.stages > 1:
                        run = compare_stages(hw, planner_model, rl_stages(trace, args.stages),
                                             num_devices=args.num_devices, planner_config=cfg,
                                             with_oracle=not args.no_oracle, with_lookahead=la, room=args.room,
                                             oracle_kw=QUICK_ORACLE if args.quick_oracle else None)
                        cmps = zip(tags, [run.first, run.steady])
                    else:
                        cmps = zip(tags, [compare(hw, planner_model, trace, num_devices=args.num_devices,
                                                  planner_config=cfg, with_oracle=not args.no_oracle,
                                                  with_lookahead=la, mixed=mixed, with_mixed_pat=mpat,
                                                  room=args.room)])
                    for tag, cmp in cmps:
                        _row(cmp, tag, model, gpu, variant, name, trace, la, mixed, ratios)
    print()
    _summaries(ratios, tags)
    print(f"\n(simulated in {time.perf_counter() - t_all:.0f}s; tail% = share of PAT's stage after 90% of responses "
          "finished)")


def _row(cmp: Comparison, tag: str, model: str, gpu: str, variant: str, name: str, trace: Trace, la: bool, mixed: dict | None,
         ratios: dict[str, list[float]]) -> None:
    """One row of the table (tag: "" or the stage, "first " / "steady "), its ratios appended to `ratios`."""
    by, best = cmp.by(), cmp.best_static()
    pat = by["pat"]
    orc_s = by["oracle"].latency_s if "oracle" in by else None
    orc = f"{orc_s:>7.1f}" if orc_s else f"{'-':>7}"
    verl = by["static-tp2"].latency_s
    flag, cols = "", {}
    for label, key in (("PAT", "pat"), ("PAT lookahead", "pat-lookahead")):
        if key not in by:
            continue
        rb = by[key].latency_s / best.latency_s
        ro = by[key].latency_s / orc_s if orc_s else None
        ratios[f"{tag}{label} / best static"].append(rb)
        cols[key] = f"{rb:>{8 if key == 'pat' else 7}.3f} "
        if ro is None:
            cols[key + "/orc"] = f"{'-':>7}"
            continue
        ratios[f"{tag}{label} / oracle"].append(ro)
        cols[key + "/orc"] = f"{ro:>7.3f}"
        # the oracle is a search, not a bound: a policy below it says the search missed a schedule
        if ro < 1.0 - 1e-9:
            flag += "  PAT<ORACLE" if key == "pat" else "  LA<ORACLE"
    la_cols = f" {cols['pat-lookahead']}{cols['pat-lookahead/orc']}" if la else ""
    la_layouts = f" | {by['pat-lookahead'].layouts_str()}" if la else ""
    if mixed:
        rm = by["mixed-oracle"].latency_s / by["oracle-rebalance"].latency_s
        ratios[f"{tag}Mixed oracle / uniform oracle"].append(rm)
        la_cols += f" {by['mixed-oracle'].latency_s:>7.1f} {rm:>7.3f}"
        la_layouts += f" | {by['mixed-oracle'].layouts_str()}"
    if "mixed-pat" in by:
        rp = by["mixed-pat"].latency_s / pat.latency_s
        ratios[f"{tag}Mixed PAT / PAT"].append(rp)
        la_cols += f" {by['mixed-pat'].latency_s:>7.1f} {rp:>8.3f}"
        la_layouts += f" | {by['mixed-pat'].layouts_str()}"
    print(f"{tag}{model:<10} {gpu:<4} {variant:<7} {name:<16} {trace.stats()['mean']:>5.0f} "
          f"{best.policy[7:] + f' {best.latency_s:.1f}':>13} {verl:>8.1f} {pat.latency_s:>7.1f} "
          f"{orc} {cols['pat']}{pat.latency_s / verl:>8.3f} {cols['pat/orc']} "
          f"{pat.tail_share * 100:>5.1f}{la_cols}  {pat.layouts_str()}{la_layouts}{flag}", flush=True)


def _summaries(ratios: dict[str, list[float]], tags: tuple[str, ...]) -> None:
    for label, xs in ratios.items():
        if xs:
            print(f"{label}: {len(xs)} rows, median {statistics.median(xs):.3f}, worst {max(xs):.3f}, best "
                  f"{min(xs):.3f}, within 2%: {sum(x <= 1.02 for x in xs)}, below 1: {sum(x < 1.0 for x in xs)}")
    xs = ratios[f"{tags[0]}Mixed oracle / uniform oracle"]
    if xs:
        build = statistics.median(xs) <= 0.98 or min(xs) <= 0.95
        print(f"Issue #26 decision: mixed / uniform oracle median {statistics.median(xs):.3f}, best {min(xs):.3f} "
              f"-> {'build mixed layouts for real' if build else 'do not build (below the 2% median / 5% row bar)'}")


if __name__ == "__main__":
    main()
