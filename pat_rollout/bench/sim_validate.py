"""Validate the simulator against the real reference engine on the CPU pool.

    python -m pat_rollout.bench.sim_validate [--rounds 3] [--profile cpu_ref_llama_demo]
    python -m pat_rollout.bench.sim_validate --measured FILE   # predict only, against stored measurements

Measures (RolloutDriver, 2 Ray actors, the demo model) static 2xTP1, static 1xTP2, PAT on the measured CPU
profile and PAT on the H100 profile (which makes the planner reconfigure mid-decode on this pool) on three skewed
batches: rounds are interleaved (every config and batch once per round, fresh driver per config and round), the
median and min-max over rounds are printed. Beside each measurement it prints the simulator's prediction from a
latency profile measured on this pool by `python -m pat_rollout.profile` (the simulator's ground truth here) with
the driver's own poll loop modelled (`sim.hardware.DriverModel`). Wrap it in `flock -x /tmp/pat_cpu.lock`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import time
from pathlib import Path

from pat_rollout.bench.sim_validate_configs import CONFIGS, EAGER
from pat_rollout.bench.sim_validate_report import report

DATA = Path(__file__).resolve().parent / "data"
STEPS_PER_POLL = 4
NUM_KV_BLOCKS = 512


def batch_specs() -> dict[str, list[tuple[int, int]]]:
    """(prompt_len, response_len) per request of each validation batch (deterministic)."""
    def demo(num: int, num_long: int, short: int, long: int, seed: int) -> list[tuple[int, int]]:
        rng = random.Random(seed)  # the same draws as pat_rollout.demo.skewed_batch
        out = []
        for i in range(num):
            plen = rng.randrange(8, 33)
            [rng.randrange(3, 2000) for _ in range(plen)]  # noqa: B018 (token ids: keep the RNG stream in step)
            out.append((plen, long if i < num_long else rng.randrange(short // 2, short + 1)))
        return out

    rng = random.Random(7)
    graded = [(rng.randrange(8, 33), min(400, max(8, round(rng.lognormvariate(3.6, 0.9))))) for _ in range(24)]
    return {"demo (16 req, 1 long 320)": demo(16, 1, 32, 320, 0),
            "two long (16 req, 2 long 240)": demo(16, 2, 48, 240, 1),
            "lognormal (24 req, max 400)": graded}


def _requests(spec: list[tuple[int, int]], tag: str):
    from pat_rollout.types import Request, SamplingParams

    rng = random.Random(hash(tag) & 0xFFFF)
    return [Request(request_id=f"{tag}-{i}", prompt_token_ids=tuple(rng.randrange(3, 2000) for _ in range(plen)),
                    sampling=SamplingParams(max_new_tokens=n, ignore_eos=True)) for i, (plen, n) in enumerate(spec)]


def measure(rounds: int, out: Path, append: bool = False) -> dict:
    """Run every config on every batch once per round; returns and writes {"runs": {config: {batch: [run]}}}.
    `append` adds the rounds to those already in `out` (so each lock hold stays short)."""
    import ray

    from pat_rollout.config import PatRolloutConfig
    from pat_rollout.driver import RolloutDriver
    from pat_rollout.models import make_tiny_model

    model_path = str(make_tiny_model(Path(os.path.expanduser("~/.cache/pat_rollout/models")) / "llama-demo",
                                     "llama-demo"))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    specs = batch_specs()
    res: dict = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M"), "steps_per_poll": STEPS_PER_POLL,
                          "num_kv_blocks": NUM_KV_BLOCKS, "rounds": rounds, "batches": specs}, "runs": {}}
    if append and out.is_file():
        res = json.loads(out.read_text())
        res["meta"]["rounds"] += rounds
    try:
        for rnd in range(rounds):
            for name, (policy, tp, prof) in CONFIGS.items():
                cfg = PatRolloutConfig(model_path=model_path, num_devices=2, policy=policy, initial_tp=tp,
                                       kv_handoff="auto", num_kv_blocks=NUM_KV_BLOCKS, steps_per_poll=STEPS_PER_POLL,
                                       planner=EAGER if policy == "pat" else {}, profile_path=prof)
                driver = RolloutDriver(cfg)
                try:
                    driver.generate(_requests(specs[next(iter(specs))][-2:], f"warm{rnd}"))
                    for bname, spec in specs.items():
                        reqs = _requests(spec, f"r{rnd}-{bname[:4]}")
                        t0 = time.perf_counter()
                        driver.generate(reqs)
                        dt = time.perf_counter() - t0
                        m = driver.stage_metrics()
                        run = {"seconds": dt, "layouts": m.get("pat/layouts"), "layout_polls": m.get("pat/layout_polls"),
                               "num_reconfigs": m.get("pat/num_reconfigs"),
                               "phases": {k: v for k, v in m.items() if "/reconfig_" in k}}
                        res["runs"].setdefault(name, {}).setdefault(bname, []).append(run)
                        print(f"round {rnd} {name:<18} {bname:<30} {dt:7.2f}s  {run['layouts']}", flush=True)
                finally:
                    driver.shutdown()
    finally:
        ray.shutdown()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--append", action="store_true", help="add the rounds to those already in --out")
    ap.add_argument("--measure-only", action="store_true")
    ap.add_argument("--measured", help="skip measuring: read this file written by an earlier run")
    ap.add_argument("--out", default=str(DATA / "sim_validate_measured.json"))
    ap.add_argument("--profile", action="append",
                    help="profile(s) the simulator uses as ground truth (default: cpu_ref_llama_demo)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.measured:
        measured = json.loads(Path(args.measured).read_text())
    else:
        measured = measure(args.rounds, Path(args.out), args.append)
        if args.measure_only:
            return
    report(measured, args.profile or ["cpu_ref_llama_demo"])


if __name__ == "__main__":
    main()
