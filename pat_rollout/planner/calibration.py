"""Online calibration of the latency profile from what the pool measures while it runs. Pure stdlib.

The driver reports every decode poll (TP, each busy replica's batch and mean context, steps, wall time) and every
reconfiguration (TP pair, running requests' tokens, wall time). Decode: a multiplicative factor per (TP, batch
bucket), the EWMA of log(measured / profile); a point never observed borrows the nearest bucket of its TP, else the
geometric mean of the other TPs' factors (a machine-wide error), else 1. Overhead: an additive bias per (src, dst)
TP pair, the EWMA of measured - predicted; an unobserved pair borrows its reverse pair's bias, else 0.
`CalibratedModel` is the profile with those corrections, so the estimator and cost model need no change.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from pat_rollout.planner.cost import TransitionCost, transition_cost
from pat_rollout.profile.model import LatencyModel

MAX_LOG_FACTOR = math.log(20.0)  # a factor beyond 20x is a broken measurement, not a profile error


def batch_bucket(batch: float) -> int:
    """Calibration bucket of a replica batch: floor(log2(batch)), so 1 | 2-3 | 4-7 | 8-15 | ..."""
    return max(0, int(math.log2(max(1.0, batch))))


@dataclass(frozen=True, kw_only=True, slots=True)
class PollSample:
    """One decode poll: `num_steps` steps of every busy replica of a TP=`tp` layout, `elapsed_s` wall time;
    `replicas` holds (mean batch, mean context tokens) of each busy replica over the poll."""

    tp: int
    replicas: tuple[tuple[float, float], ...]
    num_steps: int
    elapsed_s: float

    def __post_init__(self) -> None:
        if self.tp < 1 or self.num_steps < 1 or self.elapsed_s <= 0 or not self.replicas:
            raise ValueError(f"poll sample: tp={self.tp}, num_steps={self.num_steps} must be >= 1, elapsed_s="
                             f"{self.elapsed_s} > 0 and replicas={self.replicas} non-empty")
        if any(b < 1 or c < 0 for b, c in self.replicas):
            raise ValueError(f"poll sample: replicas={self.replicas} need batch >= 1 and context >= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class ReconfigSample:
    """One reconfiguration of `num_devices` devices from TP `tp_src` to `tp_dst` with running requests of
    `num_tokens` tokens each (empty at a stage start), `elapsed_s` wall time of all its phases."""

    num_devices: int
    tp_src: int
    tp_dst: int
    num_tokens: tuple[int, ...]
    elapsed_s: float

    def __post_init__(self) -> None:
        if self.tp_src == self.tp_dst or self.elapsed_s < 0:
            raise ValueError(f"reconfig sample: tp_src={self.tp_src} must differ from tp_dst={self.tp_dst} and "
                             f"elapsed_s={self.elapsed_s} be >= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class CalibrationConfig:
    """- alpha: EWMA weight of the newest sample (1 = trust only the last poll).
    - enabled: False keeps recording the error metrics but never corrects the profile."""

    alpha: float = 0.5
    enabled: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha={self.alpha} must be in (0, 1]")


class Calibration:
    """Corrections learned from measurements, kept across stages; `bind(key)` resets them when the model or the
    layout set changes. Per-stage error statistics for the metrics are reset by `start_stage()`."""

    def __init__(self, config: CalibrationConfig | None = None) -> None:
        self.config = config or CalibrationConfig()
        self.key: Any = None
        self.reset()

    def reset(self) -> None:
        """Forget every correction (a new model, a new layout set or a new profile)."""
        self._log_factor: dict[tuple[int, int], float] = {}  # (tp, batch bucket) -> EWMA of log(measured/profile)
        self._num_polls: dict[int, int] = {}  # tp -> polls observed
        self._bias_s: dict[tuple[int, int], float] = {}  # (tp_src, tp_dst) -> EWMA of measured - predicted
        self._factor_memo: dict[tuple[int, int], float] = {}  # decode_factor per (tp, bucket) until the next poll
        self.start_stage()

    def bind(self, key: Any) -> bool:
        """Reset if `key` (what the measurements are valid for: model, devices, TP sizes) changed; True if it did."""
        if key == self.key:
            return False
        self.key = key
        self.reset()
        return True

    def start_stage(self) -> None:
        self._stage_raw_err: list[float] = []
        self._stage_cal_err: list[float] = []
        self._stage_overhead: list[tuple[float, float, float]] = []  # (measured, profile, calibrated) seconds

    # ---- what was measured ----------------------------------------------------------------------
    def observe_poll(self, model: LatencyModel, sample: PollSample) -> tuple[float, float]:
        """Record a poll; returns (profile's prediction, calibrated prediction before this sample) in seconds."""
        raw, bucket = self._predict_poll(model, sample, calibrated=False)
        cal, _ = self._predict_poll(model, sample, calibrated=True)
        self._stage_raw_err.append(abs(sample.elapsed_s / raw - 1.0))
        self._stage_cal_err.append(abs(sample.elapsed_s / cal - 1.0))
        log_ratio = max(-MAX_LOG_FACTOR, min(MAX_LOG_FACTOR, math.log(sample.elapsed_s / raw)))
        key = (sample.tp, bucket)
        old = self._log_factor.get(key)
        self._log_factor[key] = log_ratio if old is None else old + self.config.alpha * (log_ratio - old)
        self._factor_memo.clear()
        self._num_polls[sample.tp] = self._num_polls.get(sample.tp, 0) + 1
        return raw, cal

    def observe_reconfig(self, model: LatencyModel, sample: ReconfigSample) -> tuple[float, float]:
        """Record a reconfiguration; returns (profile's predicted overhead, calibrated one before it) in seconds."""
        raw = transition_cost(model, num_devices=sample.num_devices, tp_src=sample.tp_src, tp_dst=sample.tp_dst,
                              num_tokens=sample.num_tokens).total_s
        cal = raw + self.overhead_bias_s(sample.tp_src, sample.tp_dst)
        self._stage_overhead.append((sample.elapsed_s, raw, cal))
        key = (sample.tp_src, sample.tp_dst)
        old = self._bias_s.get(key)
        err = sample.elapsed_s - raw
        self._bias_s[key] = err if old is None else old + self.config.alpha * (err - old)
        return raw, cal

    # ---- corrections ----------------------------------------------------------------------------
    def observed_tps(self) -> frozenset[int]:
        """TP sizes with at least one decode poll measured."""
        return frozenset(self._num_polls)

    def profile_error(self) -> float:
        """How wrong the profile has proven on this pool: the largest |factor - 1| over the measured TPs (each TP's
        factor the geometric mean over its batch buckets); 0 with nothing measured or calibration disabled. A TP
        never measured may be off by as much: the planner asks that much more of a switch there."""
        if not self.config.enabled or not self._log_factor:
            return 0.0
        per_tp: dict[int, list[float]] = {}
        for (t, _), v in self._log_factor.items():
            per_tp.setdefault(t, []).append(v)
        return max(abs(math.exp(sum(v) / len(v)) - 1.0) for v in per_tp.values())

    def decode_factor(self, tp: int, batch: float) -> float:
        """Measured / profile decode-step time expected at (tp, batch); 1 with nothing measured or disabled."""
        if not self.config.enabled or not self._log_factor:
            return 1.0
        bucket = batch_bucket(batch)
        out = self._factor_memo.get((tp, bucket))
        if out is None:
            out = self._factor_memo[(tp, bucket)] = self._decode_factor(tp, bucket)
        return out

    def _decode_factor(self, tp: int, bucket: int) -> float:
        same_tp = [(abs(b - bucket), b) for t, b in self._log_factor if t == tp]
        if same_tp:
            return math.exp(self._log_factor[(tp, min(same_tp)[1])])
        per_tp: dict[int, list[float]] = {}
        for (t, _), v in self._log_factor.items():
            per_tp.setdefault(t, []).append(v)
        return math.exp(sum(sum(v) / len(v) for v in per_tp.values()) / len(per_tp))

    def overhead_bias_s(self, tp_src: int, tp_dst: int) -> float:
        """Seconds to add to the profile's predicted overhead of a tp_src -> tp_dst switch (0 if disabled)."""
        if not self.config.enabled:
            return 0.0
        return self._bias_s.get((tp_src, tp_dst), self._bias_s.get((tp_dst, tp_src), 0.0))

    def correct_cost(self, cost: TransitionCost, tp_src: int, tp_dst: int) -> TransitionCost:
        """`cost` with the learned bias folded into its switch time (never below zero in total)."""
        if tp_src == tp_dst:
            return cost
        bias = max(self.overhead_bias_s(tp_src, tp_dst), -cost.total_s)
        return dataclasses.replace(cost, switch_s=cost.switch_s + bias)

    def model(self, base: LatencyModel) -> LatencyModel:
        """`base` with decode times corrected (itself when nothing is measured or calibration is disabled)."""
        if not self.config.enabled or not self._log_factor:
            return base
        return CalibratedModel(base, self)

    def metrics(self, prefix: str = "pat") -> dict[str, float]:
        """This stage's profile error (mean |measured / predicted - 1| over polls) before and after calibration,
        the current factor per TP and the overhead errors."""
        out: dict[str, float] = {f"{prefix}/calibration_polls": float(len(self._stage_raw_err))}
        if self._stage_raw_err:
            out[f"{prefix}/profile_error"] = sum(self._stage_raw_err) / len(self._stage_raw_err)
            out[f"{prefix}/calibrated_error"] = sum(self._stage_cal_err) / len(self._stage_cal_err)
        for tp in sorted(self._num_polls):
            vals = [v for (t, _), v in self._log_factor.items() if t == tp]
            out[f"{prefix}/decode_factor_tp{tp}"] = math.exp(sum(vals) / len(vals))
        if self._stage_overhead:
            n = len(self._stage_overhead)
            out[f"{prefix}/overhead_error_s"] = sum(abs(m - r) for m, r, _ in self._stage_overhead) / n
            out[f"{prefix}/calibrated_overhead_error_s"] = sum(abs(m - c) for m, _, c in self._stage_overhead) / n
        for (src, dst), b in sorted(self._bias_s.items()):
            out[f"{prefix}/overhead_bias_tp{src}_tp{dst}_s"] = b
        return out

    def _predict_poll(self, model: LatencyModel, sample: PollSample, *, calibrated: bool) -> tuple[float, int]:
        """Seconds the slowest busy replica needs for the poll, and that replica's batch bucket."""
        m = self.model(model) if calibrated else model
        worst, bucket = 0.0, 0
        for batch, context in sample.replicas:
            t = m.decode_step_s(sample.tp, batch, context + sample.num_steps / 2.0)
            if t > worst:
                worst, bucket = t, batch_bucket(batch)
        return max(worst * sample.num_steps, 1e-9), bucket


class CalibratedModel(LatencyModel):
    """A LatencyModel whose decode-step times are the base profile's times the calibration factor."""

    def __init__(self, base: LatencyModel, calibration: Calibration) -> None:
        super().__init__(meta=base.meta, model=base.model, grids=base._grids, prefill=base._prefill,
                         kv_bandwidth=base.kv_bandwidth, kv_latency_s=base.kv_latency_s,
                         reshard_bandwidth=base.reshard_bandwidth, reshard_fixed_s=base.reshard_fixed_s,
                         group_switch_s=base.group_switch_s, memory=base.memory)
        self.calibration = calibration

    def decode_step_s(self, tp: int, batch: float, context: float) -> float:
        return super().decode_step_s(tp, batch, context) * self.calibration.decode_factor(tp, batch)

