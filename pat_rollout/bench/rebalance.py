"""Rebalancing across replicas on the CPU pool: a batch whose dispatch leaves every long request on one replica.

    python -m pat_rollout.bench.rebalance [--repeats 5] [--long 4] [--long-len 192] [--modes greedy,sampled]

2 Ray actors as 2 x TP1. The driver dispatches least-inflight (as verl's balancer), alternating replicas, and the
batch is ordered so every long request lands on replica 0: once the short ones finish, replica 1 idles while
replica 0 decodes all the long ones. Two drivers run the same batch, interleaved repeat by repeat: static 2 x TP1,
and PAT with the profile measured on these CPUs (stay / rebalance / regroup to TP2, chosen by the planner on
predicted lengths). Greedy and seeded sampling; outputs must be identical across runs and repeats.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
from pathlib import Path

from pat_rollout.bench.side_by_side import RunResult, interleaved_generate
from pat_rollout.config import PatRolloutConfig
from pat_rollout.demo import skewed_batch
from pat_rollout.types import Request, SamplingParams

EAGER = {"eval_every_steps": 8, "min_steps_between_switches": 16, "min_gain_s": 0.0}


def imbalanced_batch(num_requests: int, num_long: int, short_len: int, long_len: int, temperature: float,
                     num_replicas: int = 2) -> list[Request]:
    """`skewed_batch`, reordered so alternating dispatch puts its `num_long` long requests on replica 0."""
    reqs = skewed_batch(num_requests, num_long, short_len, long_len, vocab=2000)
    if temperature:
        reqs = [Request(request_id=r.request_id, prompt_token_ids=r.prompt_token_ids,
                        sampling=SamplingParams(max_new_tokens=r.sampling.max_new_tokens, ignore_eos=True,
                                                temperature=temperature, top_p=0.9, seed=100 + i))
                for i, r in enumerate(reqs)]
    longs, shorts = reqs[:num_long], reqs[num_long:]
    out: list[Request] = []
    while longs or shorts:
        out.append(longs.pop(0) if len(out) % num_replicas == 0 and longs else shorts.pop(0))
    return out


def _spread(xs: list[float]) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}"


def print_rows(title: str, results: dict[str, RunResult]) -> bool:
    """Median and min-max of generation time and of the replica finish spread, ratio to static, rebalances and
    whether every repeat of every run produced the same tokens; returns that last answer."""
    ref = [o.token_ids for o in next(iter(results.values())).outputs]
    base = results["static 2xTP1"].seconds
    print(f"\n{title}")
    print(f"{'policy':<22}{'gen s':>8}{'min-max':>13}{'vs static':>11}{'finish spread s':>17}{'min-max':>13}"
          f"{'rebalances':>12}{'moved':>7}{'regroups':>10}{'same tokens':>13}")
    all_same = True
    for name, r in results.items():
        spread = [m["pat/replica_finish_spread_s"] for m in r.repeat_metrics]
        same = r.same_each_repeat and [o.token_ids for o in r.outputs] == ref
        all_same &= same
        m = r.metrics
        print(f"{name:<22}{r.seconds:>8.2f}{_spread(r.times):>13}{r.seconds / base:>11.3f}"
              f"{statistics.median(spread):>17.2f}{_spread(spread):>13}{m['pat/num_rebalances']:>12}"
              f"{m['pat/num_rebalanced']:>7}{m['pat/num_reconfigs']:>10}{str(same):>13}")
    return all_same


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--long", type=int, default=4, help="number of long requests (all dispatched to replica 0)")
    ap.add_argument("--short-len", type=int, default=24)
    ap.add_argument("--long-len", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds per batch (greedy, then sampled)")
    ap.add_argument("--modes", default="greedy,sampled", help="comma-separated: greedy, sampled (seeded)")
    ap.add_argument("--model", default="llama-demo", help="tiny preset to create locally")
    ap.add_argument("--model-dir", default=os.path.expanduser("~/.cache/pat_rollout/models"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    import ray

    from pat_rollout.models import make_tiny_model

    model_path = str(make_tiny_model(Path(args.model_dir) / args.model, args.model))
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    common = dict(model_path=model_path, num_devices=2, num_kv_blocks=512, steps_per_poll=4)
    runs = {"static 2xTP1": PatRolloutConfig(policy="static", **common),
            "PAT (CPU profile)": PatRolloutConfig(policy="pat", planner=EAGER, **common)}
    modes = {"greedy": ("greedy", 0.0), "sampled": ("seeded sampling (T=0.8, top-p 0.9)", 0.8)}
    unknown = sorted(set(args.modes.split(",")) - set(modes))
    if unknown:
        ap.error(f"--modes: unknown {unknown}; expected some of {sorted(modes)}")
    all_same = True
    try:
        for title, temperature in (modes[m] for m in args.modes.split(",")):
            batch = imbalanced_batch(args.requests, args.long, args.short_len, args.long_len, temperature)
            # warm-up on the batch itself: connections, first-touch allocations, and the planner's prompt history
            # (as from an earlier RL iteration), so every timed round runs under the same conditions
            results = interleaved_generate(runs, batch, warmup=batch, repeats=args.repeats)
            all_same &= print_rows(f"{title}: {len(batch)} requests, {args.long} x {args.long_len} tokens on "
                                   f"replica 0, the rest {args.short_len // 2}-{args.short_len}; "
                                   f"{args.repeats} interleaved rounds", results)
            pat = results["PAT (CPU profile)"].metrics
            phases = {k.removeprefix("pat/rebalance_").removesuffix("_s"): round(v, 4) for k, v in pat.items()
                      if k.startswith("pat/rebalance_")}
            print(f"  PAT, last round: rebalance phases (s) {phases}; {pat['pat/num_migrated']} migrated, "
                  f"{pat['pat/num_recomputed']} recomputed")
    finally:
        ray.shutdown()
    print("(gen s: median of the rounds; finish spread: last minus first replica to finish its last request)")
    if not all_same:
        sys.exit("FAIL: outputs differ between runs or repeats (see 'same tokens')")


if __name__ == "__main__":
    main()
