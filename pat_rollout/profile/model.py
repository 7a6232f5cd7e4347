"""Latency profile of one (hardware, model, backend): decode-step time per (tp, batch, context) plus the
costs the planner charges for a reconfiguration. Pure stdlib.

JSON schema, version 1 (what `to_dict` writes and `from_dict` reads; a profiler appends decode points):

    {
      "schema_version": 1,
      "meta": {"hardware": str, "model": str, "backend": str,
               "source": "measured" | "published-figures", "notes": str},
      "model": {"num_layers": int, "hidden_size": int, "num_heads": int, "num_kv_heads": int,
                "head_dim": int, "param_bytes": int, "dtype_bytes": int},
      "decode": [{"tp": int, "batch": int, "context": int, "step_s": float}, ...],
      "prefill": [{"tp": int, "tokens_per_s": float, "fixed_s": float}, ...],
      "kv_transfer": {"bandwidth_bytes_per_s": float, "latency_s": float},
      "reshard": {"bandwidth_bytes_per_s": float, "fixed_s": float},
      "group_switch_s": float,
      "memory": {"hbm_bytes": float, "mem_fraction": float, "activation_reserve_bytes": float}  (optional)
    }

Optional and additive: `meta` may hold more keys than the five strings above (e.g. "sources": which published
figure each number comes from; kept as read), and "memory" describes one device for the KV-capacity rule
(planner/capacity.py); without it the KV capacity is unknown.

`decode` must hold, for every tp, a full rectangular grid of (batch, context) points. `context` is the
mean number of tokens (prompt + generated) per running request; `step_s` is the wall time of one decode
step of one replica (TP group) running `batch` requests. Optional per decode point: `step_s_range` = [min, max]
of the repeats whose median is `step_s` (the measurement's spread; the model does not use it). `kv_transfer.bandwidth_bytes_per_s` is per device
(each device sends its own KV shard in parallel); `reshard.bandwidth_bytes_per_s` is per receiving device.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
SOURCES = ("measured", "published-figures")
DATA_DIR = Path(__file__).resolve().parent / "data"
# Published-figure profiles (profile/published.py; regenerate with write_published_profiles): one per GPU x model x
# TP-cost variant; the short names are the central variant.
BUILTIN_PROFILES = {
    **{f"{g}_{m}_{v}": f"{g}_{m}_{v}.json" for g in ("h100", "h200") for m in ("llama31_8b", "qwen3_14b")
       for v in ("low", "central", "high")},
    **{f"{g}_{m}": f"{g}_{m}_central.json" for g in ("h100", "h200") for m in ("llama31_8b", "qwen3_14b")},
}


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileModelShape:
    """Model shape as far as costs need it. `param_bytes` counts all weights (unsharded) in serving dtype."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    param_bytes: int
    dtype_bytes: int

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token, all layers and all KV heads (unsharded)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class _Grid:
    """Decode-step times of one tp on a rectangular (batch, context) grid: step_s[i][j] at batches[i], contexts[j]."""

    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    step_s: tuple[tuple[float, ...], ...]


def _segment(xs: tuple[int, ...], x: float) -> tuple[int, float]:
    """Index i and weight t of x on the segment [xs[i], xs[i+1]]; t < 0 never (clamped below), t > 1 extrapolates."""
    if len(xs) == 1 or x <= xs[0]:
        return 0, 0.0
    i = min(bisect.bisect_right(xs, x) - 1, len(xs) - 2)
    return i, (x - xs[i]) / (xs[i + 1] - xs[i])


class LatencyModel:
    """Decode/prefill/transfer latencies read from a profile (see the module docstring for the schema)."""

    def __init__(self, *, meta: dict[str, Any], model: ProfileModelShape, grids: dict[int, _Grid],
                 prefill: dict[int, tuple[float, float]], kv_bandwidth: float, kv_latency_s: float,
                 reshard_bandwidth: float, reshard_fixed_s: float, group_switch_s: float,
                 memory: dict[str, float] | None = None) -> None:
        self.meta = meta
        self.memory = memory
        self.model = model
        self._grids = grids
        self._prefill = prefill
        self.kv_bandwidth = kv_bandwidth
        self.kv_latency_s = kv_latency_s
        self.reshard_bandwidth = reshard_bandwidth
        self.reshard_fixed_s = reshard_fixed_s
        self.group_switch_s = group_switch_s

    @property
    def tps(self) -> tuple[int, ...]:
        """TP sizes the profile covers, ascending."""
        return tuple(sorted(self._grids))

    def _grid(self, tp: int) -> _Grid:
        grid = self._grids.get(tp)
        if grid is None:
            raise ValueError(f"tp={tp} is not in the profile ({self.meta.get('model')}); profiled tps={self.tps}")
        return grid

    def decode_step_s(self, tp: int, batch: float, context: float) -> float:
        """Seconds of one decode step of a TP=`tp` replica running `batch` requests of mean `context` tokens.

        Bilinear in (batch, context) inside the grid, exact at grid points; below the grid it clamps, above it
        extrapolates linearly with the last segment's slope (non-negative, as the grid is made monotone on load).
        """
        if batch <= 0:
            return 0.0
        g = self._grid(tp)
        i, tb = _segment(g.batches, batch)
        j, tc = _segment(g.contexts, context)
        s = g.step_s
        i1 = min(i + 1, len(g.batches) - 1)
        j1 = min(j + 1, len(g.contexts) - 1)
        lo = s[i][j] + tb * (s[i1][j] - s[i][j])
        hi = s[i][j1] + tb * (s[i1][j1] - s[i][j1])
        return lo + tc * (hi - lo)

    def prefill_s(self, tp: int, num_tokens: int) -> float:
        """Seconds to prefill `num_tokens` tokens (summed over requests) on one TP=`tp` replica; 0 for 0 tokens."""
        if num_tokens <= 0:
            return 0.0
        if tp not in self._prefill:
            raise ValueError(f"tp={tp} has no prefill entry in the profile; "
                             f"profiled tps={tuple(sorted(self._prefill))}")
        tokens_per_s, fixed_s = self._prefill[tp]
        return fixed_s + num_tokens / tokens_per_s

    def prefill_table(self) -> dict[int, tuple[float, float]]:
        """tp -> (prefill tokens/s, fixed seconds) as profiled."""
        return dict(self._prefill)

    def kv_migrate_s(self, num_bytes: float) -> float:
        """Seconds for one device to send `num_bytes` of KV to another; 0 for 0 bytes."""
        return 0.0 if num_bytes <= 0 else self.kv_latency_s + num_bytes / self.kv_bandwidth

    def reshard_s(self, num_bytes: float) -> float:
        """Seconds for one device to receive `num_bytes` of weights; 0 for 0 bytes."""
        return 0.0 if num_bytes <= 0 else self.reshard_fixed_s + num_bytes / self.reshard_bandwidth

    @classmethod
    def from_json(cls, path: str | Path) -> LatencyModel:
        """Load a profile file, a builtin name from BUILTIN_PROFILES (e.g. "h100_llama31_8b") or data/<name>.json."""
        p = Path(DATA_DIR / BUILTIN_PROFILES[str(path)]) if str(path) in BUILTIN_PROFILES else Path(path)
        if not p.is_file() and (DATA_DIR / f"{path}.json").is_file():  # e.g. "cpu_ref_llama_demo"
            p = DATA_DIR / f"{path}.json"
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"profile {p}: not valid JSON: {e}") from e
        try:
            return cls.from_dict(data)
        except ValueError as e:
            e.add_note(f"while reading profile {p}")
            raise

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LatencyModel:
        """Validate and parse a schema-v1 dict; ValueError names the offending field."""
        if not isinstance(d, dict):
            raise ValueError(f"profile must be a JSON object, got {type(d).__name__}")
        version = _req(d, "schema_version", int, "")
        if version != SCHEMA_VERSION:
            raise ValueError(f"schema_version={version} is not supported; this reader knows {SCHEMA_VERSION}")
        meta_d = _req(d, "meta", dict, "")
        meta = {**meta_d, **{k: _req(meta_d, k, str, "meta.") for k in ("hardware", "model", "backend", "source",
                                                                         "notes")}}
        if meta["source"] not in SOURCES:
            raise ValueError(f"meta.source={meta['source']!r} must be one of {SOURCES}")
        md = _req(d, "model", dict, "")
        shape = ProfileModelShape(**{k: _req(md, k, int, "model.") for k in (
            "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "param_bytes", "dtype_bytes")})
        for k in ProfileModelShape.__slots__:
            if getattr(shape, k) <= 0:
                raise ValueError(f"model.{k}={getattr(shape, k)} must be positive")
        grids = _parse_grids(_req(d, "decode", list, ""))
        prefill: dict[int, tuple[float, float]] = {}
        for n, e in enumerate(_req(d, "prefill", list, "")):
            where = f"prefill[{n}]."
            tp, tps_, fixed = _req(e, "tp", int, where), _num(e, "tokens_per_s", where), _num(e, "fixed_s", where)
            if tps_ <= 0 or fixed < 0:
                raise ValueError(f"{where}tokens_per_s={tps_} must be > 0 and {where}fixed_s={fixed} >= 0")
            prefill[tp] = (tps_, fixed)
        if set(prefill) != set(grids):
            raise ValueError(f"prefill tps={sorted(prefill)} must equal decode tps={sorted(grids)}")
        kv = _req(d, "kv_transfer", dict, "")
        rs = _req(d, "reshard", dict, "")
        vals = {
            "kv_transfer.bandwidth_bytes_per_s": _num(kv, "bandwidth_bytes_per_s", "kv_transfer."),
            "kv_transfer.latency_s": _num(kv, "latency_s", "kv_transfer."),
            "reshard.bandwidth_bytes_per_s": _num(rs, "bandwidth_bytes_per_s", "reshard."),
            "reshard.fixed_s": _num(rs, "fixed_s", "reshard."),
            "group_switch_s": _num(d, "group_switch_s", ""),
        }
        for k, v in vals.items():
            if v < 0 or (k.endswith("bandwidth_bytes_per_s") and v == 0):
                raise ValueError(f"{k}={v} must be {'> 0' if 'bandwidth' in k else '>= 0'}")
        memory = None
        if "memory" in d:
            mem_d = _req(d, "memory", dict, "")
            memory = {k: _num(mem_d, k, "memory.") for k in ("hbm_bytes", "mem_fraction", "activation_reserve_bytes")}
            if memory["hbm_bytes"] <= 0 or not 0 < memory["mem_fraction"] <= 1 or memory["activation_reserve_bytes"] < 0:
                raise ValueError(f"memory={memory}: hbm_bytes must be > 0, mem_fraction in (0, 1], "
                                 f"activation_reserve_bytes >= 0")
        return cls(meta=meta, model=shape, grids=grids, prefill=prefill,
                   kv_bandwidth=vals["kv_transfer.bandwidth_bytes_per_s"], kv_latency_s=vals["kv_transfer.latency_s"],
                   reshard_bandwidth=vals["reshard.bandwidth_bytes_per_s"], reshard_fixed_s=vals["reshard.fixed_s"],
                   group_switch_s=vals["group_switch_s"], memory=memory)

    def to_dict(self) -> dict[str, Any]:
        """The schema-v1 dict (the monotone envelope of the decode grid, as used)."""
        decode = [{"tp": tp, "batch": b, "context": c, "step_s": g.step_s[i][j]}
                  for tp, g in sorted(self._grids.items())
                  for i, b in enumerate(g.batches) for j, c in enumerate(g.contexts)]
        out = {
            "schema_version": SCHEMA_VERSION,
            "meta": dict(self.meta),
            "model": {k: getattr(self.model, k) for k in ProfileModelShape.__slots__},
            "decode": decode,
            "prefill": [{"tp": tp, "tokens_per_s": v[0], "fixed_s": v[1]} for tp, v in sorted(self._prefill.items())],
            "kv_transfer": {"bandwidth_bytes_per_s": self.kv_bandwidth, "latency_s": self.kv_latency_s},
            "reshard": {"bandwidth_bytes_per_s": self.reshard_bandwidth, "fixed_s": self.reshard_fixed_s},
            "group_switch_s": self.group_switch_s,
        }
        if self.memory is not None:
            out["memory"] = dict(self.memory)
        return out


def _req(d: Any, key: str, typ: type, where: str) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise ValueError(f"profile field {where}{key} is missing")
    v = d[key]
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise ValueError(f"profile field {where}{key}={v!r} must be {typ.__name__}, got {type(v).__name__}")
    return v


def _num(d: Any, key: str, where: str) -> float:
    if not isinstance(d, dict) or key not in d:
        raise ValueError(f"profile field {where}{key} is missing")
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"profile field {where}{key}={v!r} must be a finite number")
    return float(v)


def _parse_grids(points: list[Any]) -> dict[int, _Grid]:
    if not points:
        raise ValueError("profile field decode is empty")
    raw: dict[int, dict[tuple[int, int], float]] = {}
    for n, p in enumerate(points):
        where = f"decode[{n}]."
        tp, b, c, s = _req(p, "tp", int, where), _req(p, "batch", int, where), _req(p, "context", int, where), \
            _num(p, "step_s", where)
        if tp < 1 or b < 1 or c < 1 or s <= 0:
            raise ValueError(f"{where}: tp={tp}, batch={b}, context={c} must be >= 1 and step_s={s} > 0")
        if "step_s_range" in p:
            rng = p["step_s_range"]
            if (not isinstance(rng, list) or len(rng) != 2 or any(isinstance(x, bool) or not isinstance(x, (int, float))
                                                                  or not math.isfinite(x) for x in rng)
                    or not 0 < rng[0] <= rng[1]):
                raise ValueError(f"{where}step_s_range={rng!r} must be [min, max] with 0 < min <= max")
        if (b, c) in raw.setdefault(tp, {}):
            raise ValueError(f"{where}: duplicate point tp={tp} batch={b} context={c}")
        raw[tp][(b, c)] = s
    grids = {}
    for tp, pts in raw.items():
        bs = tuple(sorted({b for b, _ in pts}))
        cs = tuple(sorted({c for _, c in pts}))
        missing = [(b, c) for b in bs for c in cs if (b, c) not in pts]
        if missing:
            raise ValueError(f"decode grid of tp={tp} is not rectangular: missing (batch, context) points {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''} of batches={bs} x contexts={cs}")
        rows = [[pts[(b, c)] for c in cs] for b in bs]
        # Monotone envelope: measured points can be noisy, and a step time that drops with more work would make
        # the estimator prefer fuller batches for no reason.
        for i in range(1, len(bs)):
            rows[i] = [max(x, y) for x, y in zip(rows[i], rows[i - 1])]
        for row in rows:
            for j in range(1, len(cs)):
                row[j] = max(row[j], row[j - 1])
        grids[tp] = _Grid(bs, cs, tuple(tuple(r) for r in rows))
    return grids
