"""Assets of the CPU example: a tiny random Llama with a tiny tokenizer, and a small arithmetic dataset in
verl's RL parquet format (data_source, prompt as chat messages, ability, reward_model.ground_truth, extra_info).

    python examples/grpo_cpu/make_assets.py --out /tmp/pat_grpo_cpu     # -> model/, data/{train,val}.parquet
    python examples/grpo_cpu/make_assets.py --out /tmp/pat_grpo_cpu --head-dim 32   # -> model_hd32/ (vLLM)

`--head-dim 32` widens the model (hidden size 4 x 32, 4 heads): vLLM's CPU attention supports head sizes from 32
up, the tiny preset's is 16 (the vLLM backend, `PAT_BACKEND=vllm` in run.sh, uses this model).

Nothing is downloaded: the model's weights are random and the tokenizer is trained offline on local text, so the
policy does not learn arithmetic in a few steps; the run exercises verl's training loop, not model quality.
Idempotent: existing assets are reused.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

DATA_SOURCE = "pat_arith"  # the reward function scores this data source (reward.py)


def arithmetic_rows(num: int, split: str, seed: int) -> list[dict]:
    """`num` problems "a + b" / "a - b" / "a * b" with small operands, answers as strings."""
    rng = random.Random(seed)
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    rows = []
    for i in range(num):
        a, b, op = rng.randint(1, 20), rng.randint(1, 9), rng.choice(sorted(ops))
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"What is {a} {op} {b}? Answer with a number."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(ops[op](a, b))},
            "extra_info": {"split": split, "index": i},
        })
    return rows


def model_dir(out: str | Path, head_dim: int | None = None) -> Path:
    """The model's folder under `out`: `model` (the tiny preset), `model_hd<N>` with head_dim N."""
    return Path(out) / ("model" if head_dim is None else f"model_hd{head_dim}")


def make_assets(out: str | Path, num_train: int = 32, num_val: int = 8, seed: int = 0,
                head_dim: int | None = None) -> Path:
    """Write `model_dir(out, head_dim)` and `out/data/{train,val}.parquet`; return `out`."""
    import pandas as pd

    from pat_rollout.models.tiny import make_tiny_model
    from pat_rollout.models.tokenizer import make_tiny_tokenizer

    out = Path(out)
    wide = {} if head_dim is None else {"head_dim": head_dim, "hidden_size": 4 * head_dim}
    make_tiny_tokenizer(make_tiny_model(model_dir(out, head_dim), "llama", seed=seed, **wide))
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    for split, num, s in (("train", num_train, seed), ("val", num_val, seed + 1)):
        path = data / f"{split}.parquet"
        if not path.exists():
            pd.DataFrame(arithmetic_rows(num, split, s)).to_parquet(path)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for model/ and data/")
    p.add_argument("--num-train", type=int, default=32)
    p.add_argument("--num-val", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=None, help="head_dim of the model (default: the tiny preset's)")
    args = p.parse_args()
    print(make_assets(args.out, args.num_train, args.num_val, head_dim=args.head_dim))


if __name__ == "__main__":
    main()
