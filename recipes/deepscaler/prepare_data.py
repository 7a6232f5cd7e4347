"""Convert DeepScaleR-Preview's deepscaler.json into verl parquet files.

Download (on a machine with internet) https://huggingface.co/datasets/agentica-org/DeepScaleR-Preview-Dataset
(file deepscaler.json: a list of {"problem", "answer", "solution"}), then:

    python3 recipes/deepscaler/prepare_data.py --input deepscaler.json --output_dir ~/data/deepscaler --val_size 500

Writes train.parquet and val.parquet with verl's RL rows:
    {data_source, prompt: [{"role": "user", "content": ...}], ability, reward_model: {ground_truth, style: "rule"},
     extra_info: {split, index, answer, solution}}
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DATA_SOURCE = "deepscaler"
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def make_row(item: dict, index: int, split: str) -> dict:
    problem, answer = item["problem"].strip(), str(item["answer"]).strip()
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{problem} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"ground_truth": answer, "style": "rule"},
        "extra_info": {"split": split, "index": index, "answer": answer, "solution": item.get("solution") or ""},
    }


def convert(input_path: str | Path, output_dir: str | Path, val_size: int = 500, seed: int = 0) -> dict[str, Path]:
    """Shuffle deterministically, hold out `val_size` rows for validation; return the written paths."""
    import pandas as pd

    items = json.loads(Path(input_path).read_text())
    if not isinstance(items, list) or not all("problem" in x and "answer" in x for x in items):
        raise ValueError(f"{input_path}: expected a JSON list of objects with 'problem' and 'answer'")
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    val_idx, train_idx = order[:val_size], order[val_size:]
    out = Path(output_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, idx in (("train", train_idx), ("val", val_idx)):
        rows = [make_row(items[i], i, split) for i in idx]
        paths[split] = out / f"{split}.parquet"
        pd.DataFrame(rows).to_parquet(paths[split], index=False)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True, help="path to deepscaler.json")
    ap.add_argument("--output_dir", default="~/data/deepscaler")
    ap.add_argument("--val_size", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for split, path in convert(args.input, args.output_dir, args.val_size, args.seed).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
