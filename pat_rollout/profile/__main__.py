"""Offline profiler CLI: measure decode/prefill/transfer/reconfiguration costs on the worker pool.

    python -m pat_rollout.profile --tiny llama-demo --devices 2 --tps 1,2 --out profile.json

Each layout is timed as the pool runs it: every replica stepping at once through the driver's RefPool.step,
repeated; the median is the profile point and the min-max range is recorded beside it (`step_s_range`).
    python -m pat_rollout.profile --model-path /path/to/hf_model --devices 2 --tps 1,2 --out profile.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Measure a PAT latency profile on the reference engine.")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-path", help="HuggingFace checkpoint folder")
    src.add_argument("--tiny", help="create this tiny preset locally (e.g. llama-demo) and profile it")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--tps", type=_ints, default=(1, 2))
    ap.add_argument("--batches", type=_ints, default=(1, 2, 4, 8, 16, 32),
                    help="requests per replica; the small ones are where a drained tail decodes")
    ap.add_argument("--contexts", type=_ints, default=(32, 128, 512))
    ap.add_argument("--steps", type=int, default=8, help="decode steps per timed repeat")
    ap.add_argument("--steps-per-call", type=int, default=4, help="decode steps per pool RPC (the driver's poll)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per point (median, range recorded)")
    ap.add_argument("--hardware", default=None, help="what machine this is, for the profile's meta")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    import ray

    from pat_rollout.models import make_tiny_model
    from pat_rollout.profile.measure import ProfileGrid, measure_profile
    from pat_rollout.profile.model import LatencyModel

    model_path = args.model_path or str(make_tiny_model(
        Path(os.path.expanduser("~/.cache/pat_rollout/models")) / args.tiny, args.tiny))
    ray.init(num_cpus=max(args.devices, 2), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        grid = ProfileGrid(tps=args.tps, batches=args.batches, contexts=args.contexts, steps=args.steps,
                           steps_per_call=args.steps_per_call, repeats=args.repeats)
        profile = measure_profile(model_path, grid, num_devices=args.devices, dtype=args.dtype,
                                  hardware=args.hardware)
    finally:
        ray.shutdown()
    LatencyModel.from_dict(profile)  # validate before writing
    Path(args.out).write_text(json.dumps(profile, indent=1))
    print(f"wrote {args.out}: {len(profile['decode'])} decode points for TP {list(args.tps)}")


if __name__ == "__main__":
    main()
