"""python -m pat_rollout.sim --profile h100_llama31_8b --trace deepscaler --num-devices 8 [--seed 0]"""

from __future__ import annotations

import argparse
import time

from pat_rollout.planner.policy import PlannerConfig
from pat_rollout.profile.model import BUILTIN_PROFILES, LatencyModel
from pat_rollout.sim.compare import compare, format_table, ratios
from pat_rollout.sim.traces import deepscaler_like, read_trace, uniform_trace, verl_like

SYNTHETIC = {"deepscaler": deepscaler_like, "verl": verl_like}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pat_rollout.sim", description=__doc__)
    ap.add_argument("--profile", default="h100_llama31_8b",
                    help=f"profile JSON path or builtin name {sorted(BUILTIN_PROFILES)}")
    ap.add_argument("--trace", default="deepscaler",
                    help="CSV/JSONL file (prompt_id, prompt_len, response_len) or deepscaler | verl | uniform")
    ap.add_argument("--num-devices", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-prompts", type=int, default=128, help="synthetic traces: prompts per stage")
    ap.add_argument("--samples-per-prompt", type=int, default=8, help="synthetic traces: responses per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="response cap (default 16384 / file max)")
    ap.add_argument("--candidate-tps", default="1,2,4,8")
    ap.add_argument("--initial-tp", type=int, default=1)
    ap.add_argument("--eval-every-steps", type=int, default=64)
    args = ap.parse_args(argv)

    model = LatencyModel.from_json(args.profile)
    if args.trace in SYNTHETIC:
        trace = SYNTHETIC[args.trace](num_prompts=args.num_prompts, samples_per_prompt=args.samples_per_prompt,
                                      max_new_tokens=args.max_new_tokens or 16384, seed=args.seed)
    elif args.trace == "uniform":
        trace = uniform_trace(num_requests=args.num_prompts * args.samples_per_prompt,
                              max_new_tokens=args.max_new_tokens or 16384)
    else:
        trace = read_trace(args.trace, max_new_tokens=args.max_new_tokens)
    cfg = PlannerConfig(candidate_tps=tuple(int(x) for x in args.candidate_tps.split(",")),
                        eval_every_steps=args.eval_every_steps)
    st = trace.stats()
    print(f"profile: {model.meta['model']} on {model.meta['hardware']} [source: {model.meta['source']}]")
    print(f"trace: {trace.name} seed={args.seed}: {st['num_requests']} requests, mean {st['mean']:.0f}, "
          f"median {st['median']:.0f}, p90 {st['p90']}, max {st['max']} tokens, {st['frac_at_cap']:.1%} at cap "
          f"{trace.max_new_tokens}; {args.num_devices} devices")
    t0 = time.perf_counter()
    results = compare(model, trace, num_devices=args.num_devices, planner_config=cfg, initial_tp=args.initial_tp)
    print(format_table(results))
    r = ratios(results)
    print(f"PAT vs best static: {r['pat_vs_best_static']:.3f}x   oracle vs best static: "
          f"{r['oracle_vs_best_static']:.3f}x   PAT vs oracle: {r['pat_vs_oracle']:.3f}x   "
          f"(simulated in {time.perf_counter() - t0:.1f}s)")
    for d in next(x for x in results if x.policy == "pat").decisions:
        print(f"  pat step {d.step}: tp {d.source_tp} -> {d.target_tp}: {d.reason}")


if __name__ == "__main__":
    main()
