"""The switch margin from the estimate's measured error, not a fixed ratio. Pure stdlib.

At each evaluation the planner records the stage's final step it predicts for the action then in force (the step
plus the lookahead's drain steps of staying, or of the action it takes). When the next stage starts, the predictions
made since the stage's last action (earlier ones were about a path not taken) are compared with the realized end
(the last step the planner saw): the stage's error is the mean relative error of the predicted remaining steps,
weighted by the realized remaining steps, plus the stage's calibrated step-time error (seconds per step, measured
by planner.calibration), as the two multiply into the remaining seconds. The margin ratio is `error_multiple` x the
EWMA of that error across stages, clamped to [min_ratio, max_ratio]; before any stage is measured (and with an
estimator that predicts no steps: "drain") it is PlannerConfig.min_gain_ratio.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class MarginConfig:
    """- adaptive: False keeps the margin at PlannerConfig.min_gain_ratio.
    - error_multiple: margin ratio = this x the measured relative error.
    - min_ratio / max_ratio: bounds of the measured margin ratio.
    - alpha: EWMA weight of the newest stage's error.
    - min_remaining_steps: predictions made closer than this to the realized end are not scored (a ratio of small
      numbers, and the last poll lags the true end by up to a poll)."""

    adaptive: bool = True
    error_multiple: float = 1.0
    min_ratio: float = 0.01
    max_ratio: float = 0.15
    alpha: float = 0.5
    min_remaining_steps: int = 64

    def __post_init__(self) -> None:
        if not 0 <= self.min_ratio <= self.max_ratio or self.error_multiple < 0 or not 0 < self.alpha <= 1:
            raise ValueError(f"margin: need 0 <= min_ratio={self.min_ratio} <= max_ratio={self.max_ratio}, "
                             f"error_multiple={self.error_multiple} >= 0, alpha={self.alpha} in (0, 1]")


class MarginTracker:
    """Predicted vs realized stage ends, across stages; `ratio` is the margin ratio to use now."""

    def __init__(self, config: MarginConfig, default_ratio: float) -> None:
        self.config = config
        self.default_ratio = default_ratio
        self.error: float | None = None  # EWMA of the stages' errors; None: nothing measured yet
        self.stage_errors: list[float] = []
        self._records: list[tuple[int, int]] = []  # (step, predicted final step) since the stage's last action
        self._last_step: int | None = None

    @property
    def ratio(self) -> float:
        c = self.config
        if not c.adaptive or self.error is None:
            return self.default_ratio
        return min(c.max_ratio, max(c.min_ratio, c.error_multiple * self.error))

    def seen(self, step: int) -> None:
        """The planner saw the stage at `step` (every poll, evaluated or not)."""
        self._last_step = step if self._last_step is None else max(self._last_step, step)

    def predict(self, step: int, final_step: int | None, *, new_action: bool) -> None:
        """At `step` the action in force is predicted to end the stage at `final_step` (None: no prediction).
        new_action: it starts now, so predictions about the previous path are dropped."""
        self.seen(step)
        if new_action:
            self._records = []
        if final_step is not None:
            self._records.append((step, final_step))

    def end_stage(self, step_time_error: float = 0.0) -> float | None:
        """Score the stage that ended (see the module doc); returns its error, None if nothing was scored."""
        records, last = self._records, self._last_step
        self._records, self._last_step = [], None
        if last is None:
            return None
        num = den = 0.0
        for step, final in records:
            real = last - step
            if real >= self.config.min_remaining_steps:
                num += abs((final - step) / real - 1.0) * real
                den += real
        if not den:
            return None
        err = num / den + max(0.0, step_time_error)
        self.stage_errors.append(err)
        self.error = err if self.error is None else self.error + self.config.alpha * (err - self.error)
        return err
