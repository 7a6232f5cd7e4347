"""Run one batch under several rollout configs, one after the other, and compare them side by side.

Shared by `pat_rollout.demo` and the benchmarks: each run gets a fresh driver and a warm-up, times only the real
generate call, and the table reports ratios to the best static layout of the same run (absolute times on a
shared machine are noise; ratios measured minutes apart on the same machine are less so).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from pat_rollout.config import PatRolloutConfig
from pat_rollout.types import Request, RequestOutput


@dataclass
class RunResult:
    times: list[float]  # one per repeat
    outputs: list[RequestOutput]  # of the last repeat
    metrics: dict  # stage metrics of the last repeat
    same_each_repeat: bool = True  # every repeat produced the same tokens
    repeat_metrics: list[dict] = field(default_factory=list)  # stage metrics of every repeat (interleaved runs)

    @property
    def seconds(self) -> float:
        """Median over repeats."""
        return statistics.median(self.times)


def timed_generate(cfg: PatRolloutConfig, requests: list[Request], warmup: list[Request],
                   repeats: int = 1) -> RunResult:
    """Generate `requests` `repeats` times on one fresh driver for `cfg` after generating `warmup` (first-touch
    allocations, connections, kernels), and shut the driver down whatever happens."""
    from pat_rollout.driver import RolloutDriver

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    driver = RolloutDriver(cfg)
    try:
        driver.generate(warmup)
        times, tokens = [], []
        for _ in range(repeats):
            if cfg.policy == "pat":  # every RL stage starts where verl's weight update leaves the pool: the base layout
                driver.reconfigure(cfg.initial_tp)
            t0 = time.perf_counter()
            outputs = driver.generate(requests)
            times.append(time.perf_counter() - t0)
            tokens.append([o.token_ids for o in outputs])
        return RunResult(times, outputs, driver.stage_metrics(), all(t == tokens[0] for t in tokens))
    finally:
        driver.shutdown()


def run_all(runs: dict[str, PatRolloutConfig], requests: list[Request], warmup: list[Request],
            repeats: int = 1) -> dict[str, RunResult]:
    results = {}
    for name, cfg in runs.items():
        print(f"running {name} ...", flush=True)
        results[name] = timed_generate(cfg, requests, warmup, repeats)
    return results


def interleaved_generate(runs: dict[str, PatRolloutConfig], requests: list[Request], warmup: list[Request],
                         repeats: int) -> dict[str, RunResult]:
    """One fresh driver per config, all alive at once: warm each up on `warmup`, then `repeats` rounds that each
    generate `requests` once on every driver in turn (order reversed every other round), so drifts of a shared
    machine hit every config alike. Shuts every driver down whatever happens."""
    from pat_rollout.driver import RolloutDriver

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    drivers: dict[str, RolloutDriver] = {}
    try:
        for name, cfg in runs.items():
            print(f"starting {name} ...", flush=True)
            drivers[name] = RolloutDriver(cfg)
            drivers[name].generate(warmup)
        times: dict[str, list[float]] = {name: [] for name in runs}
        tokens: dict[str, list] = {name: [] for name in runs}
        metrics: dict[str, list[dict]] = {name: [] for name in runs}
        outputs: dict[str, list[RequestOutput]] = {}
        for i in range(repeats):
            for name in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
                t0 = time.perf_counter()
                outputs[name] = drivers[name].generate(requests)
                times[name].append(time.perf_counter() - t0)
                tokens[name].append([o.token_ids for o in outputs[name]])
                metrics[name].append(drivers[name].stage_metrics())
        return {name: RunResult(times[name], outputs[name], metrics[name][-1],
                                all(t == tokens[name][0] for t in tokens[name]), metrics[name]) for name in runs}
    finally:
        for d in drivers.values():
            d.shutdown()


def print_table(results: dict[str, RunResult]) -> bool:
    """Print the median time (and its spread over repeats), ratio to the best run named "static ...",
    reconfigurations and whether every run (and repeat) produced the first run's tokens; returns that last answer
    for all runs (greedy runs must agree token for token)."""
    ref = [o.token_ids for o in next(iter(results.values())).outputs]
    best = min(r.seconds for name, r in results.items() if name.startswith("static"))
    width = max(len(name) for name in results) + 2
    print(f"\n{'policy':<{width}}{'gen time s':>12}{'min-max s':>14}{'vs best static':>16}{'reconfigs':>11}"
          f"{'same tokens':>13}")
    all_same = True
    for name, r in results.items():
        same = r.same_each_repeat and [o.token_ids for o in r.outputs] == ref
        all_same &= same
        spread = f"{min(r.times):.2f}-{max(r.times):.2f}"
        print(f"{name:<{width}}{r.seconds:>12.2f}{spread:>14}{r.seconds / best:>16.3f}"
              f"{r.metrics.get('pat/num_reconfigs', 0):>11}{str(same):>13}")
    if len(next(iter(results.values())).times) > 1:
        print("(gen time: median over repeats on one driver; reconfigs: of the last repeat)")
    return all_same


def print_reconfigs(name: str, metrics: dict) -> None:
    """The layouts a PAT run used over time, its reconfiguration phase times and how requests were handed off."""
    phases = {k.split("reconfig_")[1].removesuffix("_s"): round(v, 4) for k, v in metrics.items()
              if "/reconfig_" in k}
    print(f"\n{name}: layouts {metrics.get('pat/layouts')}")
    print(f"  reconfiguration phases (s, summed): {phases or 'none'}; handed off "
          f"{metrics.get('pat/num_migrated', 0)} by KV migration, {metrics.get('pat/num_recomputed', 0)} by "
          "recomputation")
