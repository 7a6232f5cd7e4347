"""How long one `Planner.decide()` takes: 1024 requests on 8 devices, 4 candidate TPs, every call a full
evaluation (eval_every_steps=1, switches never allowed to end the run: each call scores stay and every regroup).

    python -m pat_rollout.bench.planner_speed [--requests 1024] [--calls 50] [--tp 2] [--estimator lookahead]

--estimator picks PlannerConfig.estimator: "lookahead" (default here: the estimator with a speed target, issue
#24) or "drain" (the planner's default).

States are mid-stage polls of a GRPO batch (groups of 8, history from earlier iterations, requests spread over
the replicas as dispatched, a spread of generated tokens). Prints wall time and the thread's CPU time: on a shared
machine (the load average is printed) wall time includes waits for a core, CPU time is what the planner costs.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from pat_rollout.planner import ClusterState, Planner, PlannerConfig, ReqProgress
from pat_rollout.planner.config import ESTIMATORS
from pat_rollout.profile.model import LatencyModel


def poll_state(rng: random.Random, *, num_requests: int, num_devices: int, tp: int, step: int,
               max_new: int = 16384) -> ClusterState:
    """A mid-stage poll: request i of prompt i // 8, dispatched least-inflight, g tokens generated so far."""
    reps = num_devices // tp
    reqs = tuple(ReqProgress(request_id=f"r{i:05d}", prompt_key=f"p{i // 8}", num_prompt_tokens=100 + (i // 8) % 200,
                             num_output_tokens=min(max_new - 1, int(rng.random() * step)), max_new_tokens=max_new,
                             replica=i % reps, cached=True) for i in range(num_requests))
    return ClusterState(step=step, num_devices=num_devices, tp=tp, requests=reqs)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--num-devices", type=int, default=8)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--profile", default="h100_llama31_8b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--estimator", choices=ESTIMATORS, default="lookahead")
    args = ap.parse_args(argv)
    model = LatencyModel.from_json(args.profile)
    cfg = PlannerConfig(candidate_tps=(1, 2, 4, 8), eval_every_steps=1, min_gain_s=1e9,  # score, never switch
                        estimator=args.estimator)
    planner = Planner(model, cfg)
    rng = random.Random(args.seed)
    for p in range(args.requests // 8 + 1):
        for _ in range(8):
            planner.observe_history(f"p{p}", int(rng.lognormvariate(8.0, 0.8)))
    wall, cpu = [], []
    for k in range(args.calls):
        state = poll_state(rng, num_requests=args.requests, num_devices=args.num_devices, tp=args.tp,
                           step=256 + 64 * k)
        t0, c0 = time.perf_counter(), time.thread_time()
        planner.decide(state)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)

    def stats(xs: list[float]) -> str:
        xs = sorted(xs)
        p99 = xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))]
        return f"median {statistics.median(xs) * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms"

    print(f"decide() [{args.estimator}]: {args.requests} requests, {args.num_devices} devices at tp={args.tp}, candidate TPs "
          f"{cfg.candidate_tps}, {args.calls} calls: wall {stats(wall)}; thread CPU {stats(cpu)} (load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs: wall times above CPU time are waits for a core)")


if __name__ == "__main__":
    main()
