"""Response-length traces of one generation stage: seeded synthetic generators and CSV/JSONL readers.
Pure stdlib (random, csv, json)."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import random
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

COLUMNS = ("prompt_id", "prompt_len", "response_len")


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceRecord:
    """One request of a stage: its prompt, prompt length and final response length (tokens); `max_new_tokens`,
    when set, is this request's own cap (else the trace's)."""

    prompt_id: str
    prompt_len: int
    response_len: int
    max_new_tokens: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Trace:
    """The requests of one stage, the response cap, and optional lengths of the same prompts from earlier
    iterations (`history`, what the length predictor may learn from)."""

    name: str
    records: tuple[TraceRecord, ...]
    max_new_tokens: int
    history: tuple[TraceRecord, ...] = ()

    def __post_init__(self) -> None:
        if not self.records:
            raise ValueError(f"trace {self.name!r} has no records")
        for r in self.records:
            cap = r.max_new_tokens or self.max_new_tokens
            if r.response_len < 1 or r.response_len > cap or cap > self.max_new_tokens or r.prompt_len < 1:
                raise ValueError(f"trace {self.name!r}: record {r} needs 1 <= response_len <= max_new_tokens="
                                 f"{self.max_new_tokens} and prompt_len >= 1")

    def stats(self) -> dict[str, float]:
        """mean / median / p90 / max response length and the fraction that hit max_new_tokens."""
        lens = sorted(r.response_len for r in self.records)
        return {"num_requests": len(lens), "mean": statistics.fmean(lens), "median": statistics.median(lens),
                "p90": lens[int(0.9 * (len(lens) - 1))], "max": lens[-1],
                "frac_at_cap": sum(x >= self.max_new_tokens for x in lens) / len(lens)}


def _lognormal_trace(name: str, *, num_prompts: int, samples_per_prompt: int, max_new_tokens: int, seed: int,
                     history_iters: int, prompt_mu: Callable[[random.Random], float], sample_sigma: float) -> Trace:
    rng = random.Random(seed)
    prompts = []
    for p in range(num_prompts):
        prompts.append((f"p{p}", max(16, round(rng.lognormvariate(math.log(160), 0.5))), prompt_mu(rng)))

    def draw(r: random.Random) -> tuple[TraceRecord, ...]:
        return tuple(TraceRecord(prompt_id=pid, prompt_len=plen,
                                 response_len=min(max_new_tokens, max(1, round(r.lognormvariate(mu, sample_sigma)))))
                     for pid, plen, mu in prompts for _ in range(samples_per_prompt))

    records = draw(rng)
    history = tuple(x for _ in range(history_iters) for x in draw(rng))
    return Trace(name=name, records=records, max_new_tokens=max_new_tokens, history=history)


def deepscaler_like(*, num_prompts: int = 128, samples_per_prompt: int = 8, max_new_tokens: int = 16384,
                    seed: int = 0, history_iters: int = 1) -> Trace:
    """DeepScaleR-shaped stage: mean ~5k tokens, heavy tail to the 16k cap with ~6-8% of responses truncated, and
    per-prompt correlation (each prompt has a difficulty; 20% of prompts are 'hard' and run long)."""

    def mu(rng: random.Random) -> float:
        if rng.random() < 0.2:
            return math.log(13000) + rng.gauss(0, 0.3)
        return math.log(3200) + rng.gauss(0, 0.55)

    return _lognormal_trace("deepscaler", num_prompts=num_prompts, samples_per_prompt=samples_per_prompt,
                            max_new_tokens=max_new_tokens, seed=seed, history_iters=history_iters, prompt_mu=mu,
                            sample_sigma=0.45)


def verl_like(*, num_prompts: int = 128, samples_per_prompt: int = 8, max_new_tokens: int = 16384, seed: int = 0,
              history_iters: int = 1) -> Trace:
    """Shape of a verl DeepScaleR run (verl #1458): mean ~1.2k tokens with the longest ~10k in a 1k-request batch."""

    def mu(rng: random.Random) -> float:
        return math.log(900) + rng.gauss(0, 0.5)

    return _lognormal_trace("verl", num_prompts=num_prompts, samples_per_prompt=samples_per_prompt,
                            max_new_tokens=max_new_tokens, seed=seed, history_iters=history_iters, prompt_mu=mu,
                            sample_sigma=0.6)


def uniform_trace(*, num_requests: int = 1024, response_len: int = 2048, prompt_len: int = 160,
                  max_new_tokens: int = 16384) -> Trace:
    """Every request generates exactly `response_len` tokens: no drain tail, so reconfiguring cannot pay off."""
    recs = tuple(TraceRecord(prompt_id=f"p{i // 8}", prompt_len=prompt_len, response_len=response_len)
                 for i in range(num_requests))
    return Trace(name="uniform", records=recs, max_new_tokens=max_new_tokens)


def _parse_rows(rows: Iterable[tuple[int, dict[str, object]]], path: Path) -> list[TraceRecord]:
    out = []
    for line, row in rows:
        missing = [c for c in COLUMNS if c not in row or row[c] in (None, "")]
        if missing:
            raise ValueError(f"{path}:{line}: missing {missing}; a trace needs columns/keys {list(COLUMNS)}, "
                             f"got {sorted(row)}")
        try:
            out.append(TraceRecord(prompt_id=str(row["prompt_id"]), prompt_len=int(str(row["prompt_len"])),
                                   response_len=int(str(row["response_len"]))))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}:{line}: prompt_len={row['prompt_len']!r} and response_len="
                             f"{row['response_len']!r} must be integers") from e
    return out


def read_jsonl(path: Path, expected: str = "a JSON object") -> list[tuple[int, dict]]:
    """(1-based line number, object) for every non-blank line of a JSONL file; ValueError naming the line on
    invalid JSON or a line that is not an object (`expected` says what one should be)."""
    rows = []
    for n, text in enumerate(path.read_text().splitlines()):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n + 1}: not valid JSON: {e}") from e
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{n + 1}: expected {expected}")
        rows.append((n + 1, obj))
    return rows


def read_trace(path: str | Path, *, max_new_tokens: int | None = None) -> Trace:
    """Read a .csv (header row) or .jsonl trace with prompt_id, prompt_len, response_len per request.
    max_new_tokens defaults to the longest response in the file."""
    p = Path(path)
    if p.suffix == ".csv":
        with p.open(newline="") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames is None:
                raise ValueError(f"{p}: empty CSV; expected a header with {list(COLUMNS)}")
            missing = [c for c in COLUMNS if c not in reader.fieldnames]
            if missing:
                raise ValueError(f"{p}: header {reader.fieldnames} is missing columns {missing}")
            records = _parse_rows(((n + 2, row) for n, row in enumerate(reader)), p)
    elif p.suffix in (".jsonl", ".json"):
        records = _parse_rows(read_jsonl(p, f"a JSON object with keys {list(COLUMNS)}"), p)
    else:
        raise ValueError(f"{p}: unknown trace format {p.suffix!r}; expected .csv or .jsonl")
    if not records:
        raise ValueError(f"{p}: no records")
    cap = max_new_tokens if max_new_tokens is not None else max(r.response_len for r in records)
    return Trace(name=p.stem, records=tuple(records), max_new_tokens=cap)


def rl_stages(trace: Trace, n: int) -> list[Trace]:
    """`n` RL steps of the same prompts, the last one `trace`: its `history` read as earlier draws of its batch
    (len(records) each, oldest first, as deepscaler_like(history_iters=n) makes them); each stage's history is the
    draw before it. Short of draws, the earliest stage repeats (a repeated batch, as `make demo` runs)."""
    if n < 1:
        raise ValueError(f"n={n} stages must be >= 1")
    k = len(trace.records)
    draws = [trace.history[j:j + k] for j in range(0, len(trace.history) - k + 1, k)]
    stages = [Trace(name=f"{trace.name}#{i}", records=draws[i], max_new_tokens=trace.max_new_tokens,
                    history=draws[i - 1]) for i in range(1, len(draws))]
    stages.append(dataclasses.replace(trace, history=draws[-1] if draws else trace.history))
    while len(stages) < n:
        stages.insert(0, stages[0])
    return stages[-n:]
