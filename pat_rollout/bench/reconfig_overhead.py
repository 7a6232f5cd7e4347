"""Reconfiguration overhead per phase, as fractions of one decode step, on the CPU pool.

    python -m pat_rollout.bench.reconfig_overhead [--devices 2] [--model llama-demo]

For each hand-off mode, a batch is decoding on N x TP1 when the pool switches to 1 x TPN and back;
phase times (export, KV hand-off, reshard, group switch, import) are divided by the decode-step time
measured in the same run at the base layout (N x TP1). Ratios, not absolute times: machines are noisy.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from pat_rollout.config import PatRolloutConfig
from pat_rollout.models import make_tiny_model
from pat_rollout.types import Request, SamplingParams

PHASES = ("plan", "export", "kv_handoff", "reshard", "switch", "import")


def _batch(n: int, length: int) -> list[Request]:
    return [Request(request_id=f"b{i}", prompt_token_ids=tuple(range(5 + i, 69 + i)),
                    sampling=SamplingParams(max_new_tokens=length, ignore_eos=True)) for i in range(n)]


def _step_s(driver, n: int, length: int) -> float:
    """Mean wall time of one decode step of the pool at its current layout."""
    t0 = time.perf_counter()
    driver.generate(_batch(n, length))
    return (time.perf_counter() - t0) / length


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--model", default="llama-demo")
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args(argv)
    import ray

    from pat_rollout.driver import RolloutDriver

    path = str(make_tiny_model(Path(os.path.expanduser("~/.cache/pat_rollout/models")) / args.model, args.model))
    ray.init(num_cpus=max(2, args.devices), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    rows = []
    for mode in ("migrate", "recompute"):
        cfg = PatRolloutConfig(model_path=path, num_devices=args.devices, policy="manual", kv_handoff=mode,
                               num_kv_blocks=512, steps_per_poll=4)
        driver = RolloutDriver(cfg)
        try:
            _step_s(driver, args.batch, 8)  # warm-up
            step_s = _step_s(driver, args.batch, 32)
            futures = [driver.submit(r) for r in _batch(args.batch, 256)]
            time.sleep(0.5)
            for tp in (args.devices, 1):
                driver.reconfigure(tp)
                result = driver.last_reconfig
                rows.append((mode, f"TP{1 if tp != 1 else args.devices}->TP{tp}", step_s, result.total_s,
                             result.phase_s))
            for f in futures:
                f.result()
        finally:
            driver.shutdown()
    ray.shutdown()
    print(f"\nreconfiguration overhead in decode steps of the base layout ({args.devices} CPU devices, "
          f"batch {args.batch}, model {args.model})")
    print(f"{'handoff':<10}{'switch':<10}" + "".join(f"{p:>11}" for p in PHASES) + f"{'total':>11}")
    for mode, name, step_s, total, phases in rows:
        cells = "".join(f"{phases.get(p, 0.0) / step_s:>11.2f}" for p in PHASES)
        print(f"{mode:<10}{name:<10}{cells}{total / step_s:>11.2f}")
    print("(1.00 = one decode step, measured in the same run. Recomputation's prefill runs in the first step\n"
          " after the switch, so its cost is not in these columns; migration's copy is in kv_handoff.)")


if __name__ == "__main__":
    main()
