"""Response lengths a user has, as traces: per-request CSV/JSONL, per-step JSONL lists, or a wandb export of
verl's per-step `response_length/*` columns. Pure stdlib.

- CSV (header) or JSONL (one object a line) with one row per response: `response_len` (or `response_length`,
  `length`), optional `prompt_len`, `prompt_id`, `step` (RL iteration; earlier steps become the predictor's
  history of the same prompt ids).
- JSONL with `response_lengths: [int, ...]` (and optional `step`, `prompt_len`) per line: one stage per line.
- wandb CSV export (columns named like `<run> - response_length/mean`, `.../max`, optional `/min`,
  `/clip_ratio`, `prompt_length/mean`; `__MIN`/`__MAX` columns are ignored): only statistics per step, so each
  step's lengths are synthesized as deterministic quantiles of a lognormal with that mean and an expected
  maximum of that max over `num_requests` draws, `clip_ratio` of them at the cap. Groups of
  `samples_per_prompt` consecutive responses share a prompt (no per-prompt correlation: it is not in the export).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

from pat_rollout.sim.traces import Trace, TraceRecord, read_jsonl

LENGTH_KEYS = ("response_len", "response_length", "length")


@dataclass(frozen=True, kw_only=True, slots=True)
class LengthsOptions:
    """How to read a lengths file: cap (default: the longest response or wandb max), prompt length when the file
    has none, GRPO group size, and requests per step for wandb statistics."""

    max_new_tokens: int | None = None
    prompt_len: int = 160
    samples_per_prompt: int = 8
    num_requests: int = 1024

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.samples_per_prompt < 1 or self.num_requests < 1:
            raise ValueError(f"prompt_len={self.prompt_len}, samples_per_prompt={self.samples_per_prompt} and "
                             f"num_requests={self.num_requests} must be >= 1")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")


def _int(v: object, where: str, key: str) -> int:
    try:
        return int(float(str(v)))
    except ValueError as e:
        raise ValueError(f"{where}: {key}={v!r} is not a number") from e


def _length_key(row: dict, where: str) -> str:
    for k in LENGTH_KEYS:
        if k in row and row[k] not in (None, ""):
            return k
    raise ValueError(f"{where}: no response length: expected one of {list(LENGTH_KEYS)} (or 'response_lengths' "
                     f"lists, or a wandb export with response_length/mean and /max), got keys {sorted(row)}")


def _from_rows(rows: list[tuple[str, dict]], opt: LengthsOptions, name: str) -> list[Trace]:
    steps: dict[int, list[TraceRecord]] = {}
    for where, row in rows:
        if "response_lengths" in row:
            lens = row["response_lengths"]
            if not isinstance(lens, list) or not lens:
                raise ValueError(f"{where}: response_lengths must be a non-empty list of ints")
            step = _int(row.get("step", len(steps)), where, "step")
            plen = _int(row.get("prompt_len", opt.prompt_len), where, "prompt_len")
            steps.setdefault(step, []).extend(
                TraceRecord(prompt_id=f"p{i // opt.samples_per_prompt}", prompt_len=plen,
                            response_len=_int(x, where, "response_lengths[]")) for i, x in enumerate(lens))
            continue
        key = _length_key(row, where)
        step = _int(row.get("step") or 0, where, "step")
        recs = steps.setdefault(step, [])
        pid = row.get("prompt_id")
        pid = str(pid) if pid not in (None, "") else f"p{len(recs) // opt.samples_per_prompt}"
        plen = _int(row.get("prompt_len") or opt.prompt_len, where, "prompt_len")
        recs.append(TraceRecord(prompt_id=pid, prompt_len=plen, response_len=_int(row[key], where, key)))
    return _stages(steps, opt, name)


def _stages(steps: dict[int, list[TraceRecord]], opt: LengthsOptions, name: str) -> list[Trace]:
    if not steps:
        raise ValueError(f"{name}: no response lengths")
    for s, recs in steps.items():
        bad = [r.response_len for r in recs if r.response_len < 1]
        if bad:
            raise ValueError(f"{name}: step {s} has response lengths < 1: {bad[:5]}")
    cap = opt.max_new_tokens or max(r.response_len for recs in steps.values() for r in recs)
    out, history = [], ()
    for s in sorted(steps):
        recs = tuple(TraceRecord(prompt_id=r.prompt_id, prompt_len=r.prompt_len,
                                 response_len=min(r.response_len, cap)) for r in steps[s])
        out.append(Trace(name=f"{name}@step{s}", records=recs, max_new_tokens=cap, history=history))
        history = recs
    return out


def synth_lengths(mean: float, maximum: float, n: int, cap: int, clip_ratio: float = 0.0,
                  minimum: float | None = None) -> list[int]:
    """n deterministic lognormal quantiles with mean `mean` whose largest is about `maximum`, at least
    `minimum`, `clip_ratio` of them at the cap."""
    if not 0 < mean <= maximum:
        raise ValueError(f"need 0 < mean={mean} <= max={maximum}")
    z = NormalDist().inv_cdf((n - 0.5) / n)  # the largest of the n quantiles below
    r = math.log(maximum / mean)
    disc = z * z - 2 * r
    s = z - math.sqrt(disc) if disc > 0 else z
    mu = math.log(mean) - s * s / 2
    nd = NormalDist()
    lens = [min(cap, max(1, round(math.exp(mu + s * nd.inv_cdf((i + 0.5) / n))))) for i in range(n)]
    if minimum is not None:
        lens = [max(int(minimum), x) for x in lens]
    k = round(clip_ratio * n)
    lens.sort()
    for i in range(max(0, n - k), n):
        lens[i] = cap
    return lens


def _wandb(path: Path, opt: LengthsOptions) -> list[Trace]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        cols = reader.fieldnames or []
        rows = list(reader)

    def col(suffix: str) -> str | None:
        hits = [c for c in cols if c.endswith(suffix) and not c.endswith(("__MIN", "__MAX"))]
        return hits[0] if hits else None

    c_mean, c_max = col("response_length/mean"), col("response_length/max")
    c_min, c_clip, c_prompt = col("response_length/min"), col("response_length/clip_ratio"), col("prompt_length/mean")
    c_step = next((c for c in cols if c.lower() in ("step", "_step", "global_step")), None)
    steps: dict[int, list[TraceRecord]] = {}
    n = opt.num_requests
    maxes = [float(r[c_max]) for r in rows if r.get(c_max)]
    cap = opt.max_new_tokens or int(max(maxes))
    for i, row in enumerate(rows):
        if not row.get(c_mean) or not row.get(c_max):
            continue
        where = f"{path}:{i + 2}"
        step = _int(row[c_step], where, c_step) if c_step and row.get(c_step) else i
        clip = float(row[c_clip]) if c_clip and row.get(c_clip) else 0.0
        lo = float(row[c_min]) if c_min and row.get(c_min) else None
        plen = max(1, round(float(row[c_prompt]))) if c_prompt and row.get(c_prompt) else opt.prompt_len
        lens = synth_lengths(float(row[c_mean]), float(row[c_max]), n, cap, clip, lo)
        # Interleave so that each GRPO group mixes short and long quantiles, as independent draws would.
        order = sorted(range(n), key=lambda j: ((j * 2654435761) % n, j))
        steps[step] = [TraceRecord(prompt_id=f"p{k // opt.samples_per_prompt}", prompt_len=plen,
                                   response_len=lens[j]) for k, j in enumerate(order)]
    return _stages(steps, LengthsOptions(max_new_tokens=cap, prompt_len=opt.prompt_len,
                                         samples_per_prompt=opt.samples_per_prompt, num_requests=n), path.stem)


def read_lengths(path: str | Path, opt: LengthsOptions | None = None) -> list[Trace]:
    """One trace per RL step in the file (a single stage when it has no steps), oldest first."""
    p = Path(path)
    opt = opt or LengthsOptions()
    if not p.is_file():
        raise ValueError(f"{p}: no such file")
    if p.suffix == ".csv":
        with p.open(newline="") as f:
            header = next(csv.reader(f), None)
        if header is None:
            raise ValueError(f"{p}: empty CSV")
        if any(h.endswith("response_length/mean") for h in header):
            return _wandb(p, opt)
        with p.open(newline="") as f:
            rows = [(f"{p}:{n + 2}", row) for n, row in enumerate(csv.DictReader(f))]
        return _from_rows(rows, opt, p.stem)
    if p.suffix in (".jsonl", ".json"):
        rows = [(f"{p}:{n}", obj) for n, obj in read_jsonl(p, "a JSON object per line")]
        return _from_rows(rows, opt, p.stem)
    raise ValueError(f"{p}: unknown format {p.suffix!r}; expected .csv or .jsonl")
