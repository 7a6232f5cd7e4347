"""What would PAT save on my workload? Simulate one generation stage on published-figure GPU profiles.

    python -m pat_rollout.sim --lengths FILE [--model llama31_8b] [--gpu h100] [--num-devices 8]
    python -m pat_rollout.sim --trace deepscaler [--max-new-tokens 16384] [--seed 0]

FILE: CSV or JSONL of response lengths (one row per response, or `response_lengths` lists per step), or a wandb
CSV export with verl's `response_length/mean` and `/max` columns (see pat_rollout/sim/lengths.py). Prints, for
each TP-cost variant (low / central / high: the published bracket; variants run in parallel processes), the first
stage (a fresh planner, the pool in its base layout) and the steady state (the same planner after --stages stages
of the batch, each starting where its weights were loaded) side by side: every static TP (a stock engine each),
verl's default TP2, PAT and the oracle (PAT's pool room; the quick search, sim.policies.QUICK_ORACLE: every start
TP, up to 2 grows at n/2 .. n/16 unfinished, then one pass of inserting / moving / dropping a switch on n/8
steps). Simulated, not measured: see docs/planner_results.md.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time

from pat_rollout.planner.policy import PlannerConfig
from pat_rollout.profile.published import GPUS, MODELS, VARIANTS
from pat_rollout.sim.compare import ROOMS, Comparison, compare_stages, gpu_setup, room_line, summary_line
from pat_rollout.sim.lengths import LengthsOptions, read_lengths
from pat_rollout.sim.policies import QUICK_ORACLE
from pat_rollout.sim.traces import deepscaler_like, rl_stages, uniform_trace, verl_like

SYNTHETIC = {"deepscaler": deepscaler_like, "verl": verl_like}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pat_rollout.sim", description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--lengths", help="CSV/JSONL of response lengths, or a wandb export CSV")
    src.add_argument("--trace", default="deepscaler", help="synthetic: deepscaler | verl | uniform")
    ap.add_argument("--model", default="llama31_8b", choices=sorted(MODELS))
    ap.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    ap.add_argument("--num-devices", type=int, default=8)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="TP-cost variants of the truth")
    ap.add_argument("--planner-variant", default="central", choices=VARIANTS)
    ap.add_argument("--planner-error", type=float, default=0.0, help="planner's step times x (1 + this)")
    ap.add_argument("--mem-fraction", type=float, default=None, help="default 0.6 (verl colocated rollout)")
    ap.add_argument("--step", default="last", help="lengths files with RL steps: last | all | <step index>")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--samples-per-prompt", type=int, default=8)
    ap.add_argument("--num-requests", type=int, default=1024, help="wandb export: responses per step")
    ap.add_argument("--prompt-len", type=int, default=160, help="when the file has no prompt lengths")
    ap.add_argument("--num-prompts", type=int, default=128, help="synthetic traces: prompts per stage")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--initial-tp", type=int, default=1)
    ap.add_argument("--no-oracle", action="store_true")
    ap.add_argument("--room", default="pool", choices=ROOMS,
                    help="KV room PAT and the oracle run on: pool (today's SGLang pool) or reclaiming (a grow gives "
                         "freed weight memory to the KV cache: the stock room); statics keep a stock engine's")
    ap.add_argument("--stages", type=int, default=3, help="stages of the batch; the last is the steady state")
    ap.add_argument("--jobs", type=int, default=max(1, min(3, os.cpu_count() or 1)),
                    help="variants simulated in parallel processes")
    args = ap.parse_args(argv)

    if args.lengths:
        traces = read_lengths(args.lengths, LengthsOptions(
            max_new_tokens=args.max_new_tokens, prompt_len=args.prompt_len,
            samples_per_prompt=args.samples_per_prompt, num_requests=args.num_requests))
        if args.step == "last":
            traces = traces[-1:]
        elif args.step != "all":
            traces = [traces[int(args.step)]]
    elif args.trace in SYNTHETIC:
        traces = [SYNTHETIC[args.trace](num_prompts=args.num_prompts, samples_per_prompt=args.samples_per_prompt,
                                        max_new_tokens=args.max_new_tokens or 16384, seed=args.seed,
                                        history_iters=args.stages)]
    elif args.trace == "uniform":
        traces = [uniform_trace(num_requests=args.num_prompts * args.samples_per_prompt,
                                max_new_tokens=args.max_new_tokens or 16384)]
    else:
        ap.error(f"--trace {args.trace!r}: expected deepscaler, verl or uniform (or use --lengths FILE)")
    cfg = PlannerConfig(candidate_tps=tuple(tp for tp in (1, 2, 4, 8) if args.num_devices % tp == 0))
    variants = args.variants.split(",")
    for trace in traces:
        st = trace.stats()
        print(f"trace {trace.name}: {st['num_requests']} responses, mean {st['mean']:.0f}, median {st['median']:.0f}, "
              f"p90 {st['p90']}, max {st['max']} tokens, {st['frac_at_cap']:.1%} at cap {trace.max_new_tokens}",
              flush=True)
        t0 = time.perf_counter()
        jobs = [(v, trace, args, cfg) for v in variants]
        if args.jobs > 1 and len(jobs) > 1:
            with multiprocessing.get_context("fork").Pool(min(args.jobs, len(jobs))) as pool:
                outs = pool.map(_variant, jobs)
        else:
            outs = [_variant(j) for j in jobs]
        for text in outs:
            print(text)
        print(f"\n({len(variants)} variants in {time.perf_counter() - t0:.1f}s)")


def _variant(job: tuple) -> str:
    """One TP-cost variant: the first and the steady stage, as text (run in a worker process)."""
    variant, trace, args, cfg = job
    hw, planner_model = gpu_setup(args.gpu, args.model, variant, planner_variant=args.planner_variant,
                                  planner_error=args.planner_error, mem_fraction=args.mem_fraction)
    t0 = time.perf_counter()
    total = len(cfg.candidate_tps) + args.stages + (0 if args.no_oracle else 1)
    done = [0]

    def progress(label: str) -> None:
        done[0] += 1
        n = 20 * done[0] // total
        print(f"  [{variant:<7}] [{'#' * n}{'.' * (20 - n)}] {done[0]}/{total} {label} ({time.perf_counter() - t0:.0f}s)",
              file=sys.stderr, flush=True)

    run = compare_stages(hw, planner_model, rl_stages(trace, args.stages), num_devices=args.num_devices,
                         planner_config=cfg, initial_tp=args.initial_tp, with_oracle=not args.no_oracle,
                         progress=progress, oracle_kw=QUICK_ORACLE, room=args.room)
    head = (f"\n[{variant} TP-cost variant] {hw.name}, {args.num_devices} GPUs; planner profile: "
            f"{args.planner_variant} x {1 + args.planner_error:g} (SIMULATED from published figures, not measured)\n"
            f"{room_line(hw)}; PAT and the oracle run on: {args.room}\n")
    return head + side_by_side(run.first, run.steady, args.stages) + f"  ({time.perf_counter() - t0:.1f}s)"


def side_by_side(first: Comparison, steady: Comparison, stages: int) -> str:
    """One row per policy: latency and vs the best static in the first and the steady stage, and their layouts."""
    rows = [f"{'policy':<12} {'first_s':>8} {'vs_best':>8} {'steady_s':>8} {'vs_best':>8}  first layouts | "
            f"steady layouts (stage {stages})"]
    sb = steady.by()
    f_best, s_best = first.best_static().latency_s, steady.best_static().latency_s
    for r in first.results:
        s = sb.get(r.policy)
        ss = f"{s.latency_s:>8.1f} {(s.latency_s / s_best - 1) * 100:>+7.1f}%" if s else f"{'-':>8} {'-':>8}"
        rows.append(f"{r.policy:<12} {r.latency_s:>8.1f} {(r.latency_s / f_best - 1) * 100:>+7.1f}% {ss}  "
                    f"{r.layouts_str()}" + (f" | {s.layouts_str()}" if s and s.policy in ("pat", "oracle") else ""))
    for tag, cmp in (("first", first), ("steady", steady)):
        rows.append(f"{tag}: {summary_line(cmp)}")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
