"""No-regret benchmark on the real engine: every static layout and PAT, interleaved on ONE pool, per batch.

    python -m pat_rollout.bench.no_regret [--batches uniform,skew1,skew4,skew8] [--repeats 3]

One RolloutDriver (one set of Ray actors, every TP's groups built once) runs each batch `repeats` times under every
policy, rotating the order each round so slow drifts of the machine hit every policy alike. A policy is a planner
swapped into the driver between stages: "static NxTPk" is a planner with the single candidate k (its layout is set
up before the timer starts), "PAT, measured profile" plans from profile/data/cpu_ref_llama_demo.json and "PAT, wrong
profile" from the same profile with its TP1 and TP2 decode grids swapped (it claims the losing layout wins). Each
PAT run starts from the base layout TP1 (where verl's weight update leaves the pool), so its stage-start switch is
timed as part of it; each PAT planner keeps its calibration across stages, as a driver does, and first runs
`--warmup-stages` untimed stages of a batch of the same size (as earlier RL iterations would: it measures the
batch sizes it will see, and explores a layout it never ran). `--pin` (default) pins every thread of actor i to
core i (fewer migrations; the driver's process floats).
Target: PAT's median no worse than the best static median by more than PAT's own median reconfiguration time
("strict"). The machine's run-to-run noise is reported beside it: half the min-max spread of the best static
layout's repeats on that batch, and the per-round paired difference PAT - best static (both ran in the same
round). "within noise" allows that half-spread on top of the overhead; the exit code follows it, and both verdicts
are printed.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path

from pat_rollout.bench.side_by_side import RunResult, print_table
from pat_rollout.config import PatRolloutConfig
from pat_rollout.demo import skewed_batch
from pat_rollout.models import make_tiny_model
from pat_rollout.planner import Planner, PlannerConfig
from pat_rollout.profile.model import LatencyModel
from pat_rollout.types import Request

# name -> (requests, long ones, their length); the short ones run 16-32 tokens.
BATCHES = {"uniform": (16, 16, 64), "skew1": (16, 1, 256), "skew4": (16, 4, 160), "skew8": (16, 8, 96)}
PLANNER = {"eval_every_steps": 8, "min_steps_between_switches": 16, "min_gain_s": 0.0}


def swapped_profile(model: LatencyModel, a: int, b: int) -> LatencyModel:
    """`model` with the decode grids of TP `a` and TP `b` swapped: a deliberately wrong profile."""
    d = model.to_dict()
    for p in d["decode"]:
        p["tp"] = {a: b, b: a}.get(p["tp"], p["tp"])
    d["meta"]["notes"] = f"DELIBERATELY WRONG: decode grids of TP{a} and TP{b} swapped. " + d["meta"]["notes"]
    return LatencyModel.from_dict(d)


def _timed(driver, planner: Planner, setup_tp: int, requests: list[Request]) -> tuple[float, list, dict]:
    """Put the pool in TP `setup_tp` and run a tiny stage there (untimed: whatever ran before, every policy starts
    from a pool that has just stepped in that layout; a shrink's fresh weight buffers otherwise slow the next
    stage's first steps), then swap `planner` in and time one stage of `requests`."""
    driver.reconfigure(setup_tp)
    driver.planner = Planner(driver.profile, PlannerConfig(candidate_tps=(setup_tp,)))  # stays in setup_tp
    driver.generate(skewed_batch(2, 0, 8, 8, vocab=2000, seed=5))
    driver.planner = planner  # the driver is idle between stages: its loop reads the planner only while polling
    t0 = time.perf_counter()
    outputs = driver.generate(requests)
    return time.perf_counter() - t0, outputs, driver.stage_metrics()


def pin_actors(driver) -> dict[int, int]:
    """Pin every thread of each device's actor to one core (device i -> i-th allowed core); returns pid -> core."""
    cores = sorted(os.sched_getaffinity(0))
    pinned = {}
    for info in driver.pool.info():
        pid, core = int(info["pid"]), cores[int(info["device"]) % len(cores)]
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(tid), {core})
            except ProcessLookupError:  # a thread that just ended
                pass
        pinned[pid] = core
    return pinned


def overhead_s(metrics: dict) -> float:
    """Seconds a stage spent reconfiguring (all phases, all switches)."""
    return sum(v for k, v in metrics.items() if k.startswith("pat/reconfig_") and k.endswith("_s"))


def run(args: argparse.Namespace) -> bool:
    from pat_rollout.driver import RolloutDriver
    from pat_rollout.driver.planner_glue import build_planner

    model_path = str(make_tiny_model(Path(args.model_dir) / "llama-demo", "llama-demo"))
    cfg = PatRolloutConfig(model_path=model_path, num_devices=args.devices, policy="pat", initial_tp=1,
                           num_kv_blocks=512, steps_per_poll=4, planner=PLANNER)
    driver = RolloutDriver(cfg)
    try:
        if args.pin:
            print(f"pinned actors (pid -> core): {pin_actors(driver)}", flush=True)
        tps = cfg.tp_sizes
        measured = driver.profile
        wrong = swapped_profile(measured, tps[0], tps[-1])
        policies: dict[str, tuple[Planner, int]] = {
            f"static {args.devices // tp}xTP{tp}": (Planner(measured, PlannerConfig(candidate_tps=(tp,))), tp)
            for tp in tps}
        policies["PAT, measured profile"] = (driver.planner, tps[0])
        policies["PAT, wrong profile"] = (build_planner(cfg, driver.spec, wrong), tps[0])
        warm = skewed_batch(16, 4, 32, 96, vocab=2000, seed=99)
        for name, (planner, tp) in policies.items():
            for _ in range(args.warmup_stages if name.startswith("PAT") else 1):
                _timed(driver, planner, tp, warm)
        ok = True
        for batch_name in args.batches:
            n, n_long, long_len = BATCHES[batch_name]
            # Prompts of its own per batch: the length predictor keys its history by prompt, and one prompt with
            # another batch's length would be a different workload than RL's (where a prompt's lengths correlate).
            requests = skewed_batch(n, n_long, 32, long_len, vocab=2000, seed=1 + list(BATCHES).index(batch_name))
            lengths = [r.sampling.max_new_tokens for r in requests]
            print(f"\n== batch {batch_name}: {n} requests, {n_long} of {long_len} tokens, the rest "
                  f"{min(lengths)}-{sorted(lengths)[n - n_long - 1] if n > n_long else long_len} ==", flush=True)
            results: dict[str, RunResult] = {name: RunResult([], [], {}) for name in policies}
            overheads: dict[str, list[float]] = {name: [] for name in policies}
            rounds: list[dict[str, float]] = []
            names = list(policies)
            for rep in range(args.repeats):
                rounds.append({})
                for name in names[rep % len(names):] + names[:rep % len(names)]:  # rotate: interleaved repeats
                    planner, tp = policies[name]
                    seconds, outputs, metrics = _timed(driver, planner, tp, requests)
                    r = results[name]
                    r.same_each_repeat &= not r.outputs or [o.token_ids for o in outputs] == [
                        o.token_ids for o in r.outputs]
                    r.times.append(seconds)
                    rounds[-1][name] = seconds
                    r.outputs, r.metrics = outputs, metrics
                    overheads[name].append(overhead_s(metrics))
                    print(f"  {name}: {seconds:.2f} s, layouts {metrics.get('pat/layouts')}", flush=True)
            ok &= print_table(results)
            best_name = min((n for n in names if n.startswith("static")), key=lambda n: results[n].seconds)
            best = results[best_name].seconds
            noise = (max(results[best_name].times) - min(results[best_name].times)) / 2
            for name in names:
                if name.startswith("PAT"):
                    r = results[name]
                    allowance = statistics.median(overheads[name])
                    strict = r.seconds <= best + allowance
                    within = r.seconds <= best + allowance + noise
                    ok &= within
                    paired = sorted(rd[name] - rd[best_name] for rd in rounds)
                    m = r.metrics
                    print(f"{name}: PAT/best-static {r.seconds / best:.3f}, median - best {r.seconds - best:+.2f} s "
                          f"(paired per round: median {statistics.median(paired):+.2f}, {paired[0]:+.2f}.."
                          f"{paired[-1]:+.2f} s), median reconfiguration {allowance:.2f} s, noise (half-spread of "
                          f"{best_name}) {noise:.2f} s -> strict: {'within' if strict else 'NOT within'}, "
                          f"{'within' if within else 'NOT within'} noise; last run: profile_error "
                          f"{m.get('pat/profile_error', 0):.2f}, calibrated_error {m.get('pat/calibrated_error', 0):.2f}")
        return ok
    finally:
        driver.shutdown()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--batches", default="uniform,skew1,skew4,skew8",
                    help=f"comma-separated, from {sorted(BATCHES)}")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup-stages", type=int, default=3, help="untimed stages per PAT planner first")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="pin each actor's threads to one core")
    ap.add_argument("--model-dir", default=os.path.expanduser("~/.cache/pat_rollout/models"))
    args = ap.parse_args(argv)
    args.batches = [b for b in args.batches.split(",") if b]
    unknown = sorted(set(args.batches) - set(BATCHES))
    if unknown:
        ap.error(f"unknown batches {unknown}; known: {sorted(BATCHES)}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")

    import ray

    ray.init(num_cpus=max(args.devices, 2), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}})
    try:
        ok = run(args)
    finally:
        ray.shutdown()
    if not ok:
        sys.exit("FAIL: a PAT median is beyond the best static one by more than its reconfiguration overhead plus the "
                 "measured noise, or tokens differ")


if __name__ == "__main__":
    main()
