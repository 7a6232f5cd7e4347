"""CPU demo: a skewed batch on a local Ray pool, PAT vs static TP, with the reference engine.

    python -m pat_rollout.demo [--devices 2] [--requests 16] [--long 2]

Most requests stop after a few dozen tokens, a few run long: the batch drains, and PAT regroups the
devices from N x TP1 into larger TP groups for the tail when its latency profile says that pays off.
Four runs: static N x TP1, static 1 x TPN, PAT with the profile measured on these CPUs, and PAT driven by
the published-figures H100 profile (which does not describe this hardware: the planner's online calibration
corrects it from the warm-up stage on). Each PAT stage starts from the base layout TP1, where verl's weight
update leaves the pool, and the planner picks the stage's starting layout from the batch. Every run is greedy,
so all outputs must be identical token for token; the demo checks that and prints timings side by side.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
from pathlib import Path

from pat_rollout.bench.side_by_side import print_reconfigs, print_table, run_all
from pat_rollout.config import PatRolloutConfig
from pat_rollout.models import make_tiny_model
from pat_rollout.types import Request, SamplingParams


def skewed_batch(num_requests: int, num_long: int, short_len: int, long_len: int, vocab: int,
                 seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    reqs = []
    for i in range(num_requests):
        prompt = tuple(rng.randrange(3, vocab) for _ in range(rng.randrange(8, 33)))
        n = long_len if i < num_long else rng.randrange(short_len // 2, short_len + 1)
        reqs.append(Request(request_id=f"req-{i}", prompt_token_ids=prompt,
                            sampling=SamplingParams(max_new_tokens=n, ignore_eos=True)))
    return reqs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--long", type=int, default=1, help="number of long requests")
    ap.add_argument("--short-len", type=int, default=32)
    ap.add_argument("--long-len", type=int, default=320)
    ap.add_argument("--model", default="llama-demo", help="tiny preset to create locally")
    ap.add_argument("--model-dir", default=os.path.expanduser("~/.cache/pat_rollout/models"))
    ap.add_argument("--kv-handoff", default="auto", choices=["auto", "migrate", "recompute"])
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per policy on one driver; the median is shown")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")

    import ray

    print(f"creating tiny random model {args.model!r} under {args.model_dir} ...", flush=True)
    model_path = str(make_tiny_model(Path(args.model_dir) / args.model, args.model))
    ray.init(num_cpus=max(args.devices, 2), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    requests = skewed_batch(args.requests, args.long, args.short_len, args.long_len, vocab=2000)
    lengths = [r.sampling.max_new_tokens for r in requests]
    print(f"batch: {len(requests)} requests, response lengths min {min(lengths)} / mean "
          f"{sum(lengths) / len(lengths):.0f} / max {max(lengths)} on {args.devices} CPU devices (Ray actors)")
    common = dict(model_path=model_path, num_devices=args.devices, kv_handoff=args.kv_handoff,
                  num_kv_blocks=512, steps_per_poll=4)
    eager = {"eval_every_steps": 8, "min_steps_between_switches": 16, "min_gain_s": 0.0}
    runs = {f"static {args.devices}xTP1": PatRolloutConfig(policy="static", initial_tp=1, **common),
            f"static 1xTP{args.devices}": PatRolloutConfig(policy="static", initial_tp=args.devices, **common),
            "PAT, CPU profile": PatRolloutConfig(policy="pat", initial_tp=1, planner=eager, **common),
            "PAT, H100 profile": PatRolloutConfig(policy="pat", initial_tp=1, planner=eager,
                                                  profile_path="h100_llama31_8b", **common)}
    # Warm-up on two short requests: first-touch allocations, gloo connections.
    results = run_all(runs, requests, warmup=requests[-2:], repeats=args.repeats)
    ray.shutdown()

    all_same = print_table(results)
    for name in ("PAT, CPU profile", "PAT, H100 profile"):
        print_reconfigs(name, results[name].metrics)
    print("\nfirst outputs (token ids):")
    for o in results["PAT, H100 profile"].outputs[:3]:
        print(f"  {o.request_id}: {len(o.token_ids)} tokens {list(o.token_ids[:12])} ... ({o.finish_reason})")
    if not all_same:
        sys.exit("FAIL: greedy outputs differ between runs (see 'same tokens' above)")


if __name__ == "__main__":
    main()
