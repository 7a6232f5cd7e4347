"""The vLLM pool's switch phases, old-layout engines stopped side by side vs one after another, interleaved.

    python -m pat_rollout.bench.vllm_switch [--rounds 3] [--devices 2]

In the vLLM venv (`make install-vllm`). One `VllmPool` on the tests' tiny random Llama (head_dim 32) in N x TP1;
each round runs, for each stop policy in turn, a grow N x TP1 -> 1 x TPN (N engines stopped) and a shrink back
(one engine stopped), with a few requests decoding (recomputed at each switch). "concurrent" is the pool's
`stop_all`; "sequential" stops the same engines one after another (the pool before 2026-12-08). Prints each phase
(export, stop, start, import, kv_import) per direction and policy, median [min-max] over rounds, and the ratio of
the stop phases' medians. Times are this machine's; the ratio is the result.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

from pat_rollout.bench.sglang_pat_vs_static import loadavg
from pat_rollout.bench.vllm_stock import commit
from pat_rollout.config import PatRolloutConfig
from pat_rollout.layout import Layout
from pat_rollout.types import Request, SamplingParams

POLICIES = ("concurrent", "sequential")


def stop_one_after_another(replicas: list[Any]) -> list[tuple[int, Exception]]:
    """The same stops as `pool.stop_all`, one after another."""
    errors = []
    for rep in replicas:
        try:
            rep.shutdown()
        except Exception as e:
            errors.append((rep.index, e))
    return errors


def requests(tag: str, n: int) -> list[Request]:
    sp = SamplingParams(max_new_tokens=64, ignore_eos=True)
    return [Request(request_id=f"{tag}{i}", prompt_token_ids=tuple(range(3 + i, 20 + i)), sampling=sp)
            for i in range(n)]


def switch(pool: Any, tp: int, policy: str) -> dict[str, float]:
    from pat_rollout.vllm import pool as vpool

    real = vpool.stop_all
    vpool.stop_all = real if policy == "concurrent" else stop_one_after_another
    try:
        res = pool.reconfigure(tp, {rid: 0 for rep in pool.replicas for rid in rep.tracked})
    finally:
        vpool.stop_all = real
    return {**res.phase_s, "total": res.total_s}


def fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):6.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def main(argv: list[str] | None = None) -> None:
    from pat_rollout.driver.backends import get_backend
    from pat_rollout.models import make_tiny_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--devices", type=int, default=2)
    args = ap.parse_args(argv)
    model = make_tiny_model(Path(os.path.expanduser("~/.cache/pat_rollout/models")) / "llama_hd32_4k", "llama",
                            hidden_size=128, head_dim=32, max_position_embeddings=4096)
    print(f"vllm_switch: commit {commit()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"{args.devices} CPU devices, {args.rounds} rounds; load average before: {loadavg()}", flush=True)
    config = PatRolloutConfig(model_path=str(model), num_devices=args.devices, backend="vllm", initial_tp=1,
                              candidate_tps=(1, args.devices), policy="manual", kv_handoff="recompute")
    backend = get_backend("vllm")
    pool = backend.build_pool(config, backend.model_spec(config), Layout.uniform(args.devices, 1), cost=None,
                              num_cpus_per_worker=1)
    times: dict[tuple[str, str], list[dict[str, float]]] = {}
    try:
        for rnd in range(args.rounds):
            for policy in POLICIES:
                reqs = requests(f"r{rnd}{policy[0]}", 2 * args.devices)
                pool.add_requests({r: reqs[r::args.devices] for r in range(args.devices)})
                pool.step(range(args.devices), 4)
                times.setdefault(("grow", policy), []).append(switch(pool, args.devices, policy))
                pool.step([0], 4)
                times.setdefault(("shrink", policy), []).append(switch(pool, 1, policy))
                pool.abort_all()
            print(f"round {rnd + 1}/{args.rounds} done; load average {loadavg()}", flush=True)
    finally:
        pool.shutdown()
    print(f"\nswitch phases, s: median [min-max] over {args.rounds} rounds "
          f"(grow {args.devices} x TP1 -> 1 x TP{args.devices}, shrink back)")
    phases = ("export", "stop", "start", "import", "kv_import", "total")
    print(f"{'direction':10} {'policy':11} " + " ".join(f"{p:>20}" for p in phases))
    for (direction, policy), runs in times.items():
        print(f"{direction:10} {policy:11} " + " ".join(f"{fmt([r.get(p, 0.0) for r in runs]):>20}"
                                                         for p in phases))
    for direction in ("grow", "shrink"):
        c, s = (statistics.median(r["stop"] for r in times[(direction, p)]) for p in POLICIES)
        print(f"{direction}: stop phase concurrent / sequential = {c / s:.3f} (medians {c:.2f} / {s:.2f} s)")
    print(f"load average after: {loadavg()}")


if __name__ == "__main__":
    main()
