"""Assets of the CPU example: a tiny random Llama with a tiny tokenizer, and a small arithmetic dataset in
verl's RL parquet format (data_source, prompt as chat messages, ability, reward_model.ground_truth, extra_info).

    python examples/grpo_cpu/make_assets.py --out /tmp/pat_grpo_cpu     # -> model/, data/{train,val}.parquet

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


def make_assets(out: str | Path, num_train: int = 32, num_val: int = 8, seed: int = 0) -> Path:
    """Write `out/model` and `out/data/{train,val}.parquet`; return `out`."""
    import pandas as pd

    from pat_rollout.models.tiny import make_tiny_model
    from pat_rollout.models.tokenizer import make_tiny_tokenizer

    out = Path(out)
    make_tiny_tokenizer(make_tiny_model(out / "model", "llama", seed=seed))
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
    args = p.parse_args()
    print(make_assets(args.out, args.num_train, args.num_val))


if __name__ == "__main__":
    main()
