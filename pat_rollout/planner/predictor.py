"""Predicts how many more tokens an unfinished request will generate. Pure stdlib, deterministic."""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class PredictorConfig:
    """Weights of the mixture. Each same-prompt sample longer than g counts `prompt_weight` batch samples; the
    stage (batch) component counts at most `max_stage_weight`; the prior "uniform between g and max_new_tokens"
    counts `prior_weight`. `max_history_per_prompt` keeps the latest lengths of each prompt."""

    prompt_weight: float = 4.0
    max_stage_weight: float = 32.0
    prior_weight: float = 2.0
    max_history_per_prompt: int = 64

    def __post_init__(self) -> None:
        for name in ("prompt_weight", "max_stage_weight", "prior_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.prior_weight == 0:
            raise ValueError(f"prior_weight={self.prior_weight} must be > 0 (it is the fallback without data)")
        if self.max_history_per_prompt < 1:
            raise ValueError(f"max_history_per_prompt={self.max_history_per_prompt} must be >= 1")


class _Survival:
    """Kaplan-Meier survival S(t) = P(L > t) of the stage: finished lengths are events, the generated counts of
    running requests are right-censored (those requests are known to be longer). Beyond the last event S falls
    linearly to 0 at max_new_tokens."""

    def __init__(self, finished: list[int], running: list[int]) -> None:
        events = sorted(finished)
        censored = sorted(running)
        self.times: list[int] = [0]
        self.surv: list[float] = [1.0]
        self.cum: list[float] = [0.0]  # integral of S from 0 to times[i]
        s = 1.0
        i = 0
        n = len(events)
        while i < n:
            t = events[i]
            d = bisect.bisect_right(events, t) - i
            at_risk = (n - i) + (len(censored) - bisect.bisect_left(censored, t))
            self.cum.append(self.cum[-1] + s * (t - self.times[-1]))
            s *= 1.0 - d / at_risk
            self.times.append(t)
            self.surv.append(s)
            i += d
        self.events = events

    def num_events_above(self, g: int) -> int:
        return len(self.events) - bisect.bisect_right(self.events, g)

    def mean_remaining(self, g: int, max_new_tokens: int) -> float:
        """E[L - g | L > g] under S; the linear tail makes it (max - g) / 2 past the last event."""
        k = bisect.bisect_right(self.times, g) - 1
        s_g = self.surv[k]
        t_last, s_last = self.times[-1], self.surv[-1]
        if g >= t_last or s_g <= 0.0:
            return (max_new_tokens - g) / 2.0
        integral = self.cum[-1] - self.cum[k] - s_g * (g - self.times[k])  # from g to t_last
        if s_last > 0.0 and max_new_tokens > t_last:
            integral += s_last * (max_new_tokens - t_last) / 2.0
        return integral / s_g

    def quantile_remaining(self, g: int, max_new_tokens: int, v: float) -> float:
        """The v-quantile of L - g given L > g under S (the linear tail past the last event)."""
        k = bisect.bisect_right(self.times, g) - 1
        s_g = self.surv[k]
        t_last, s_last = self.times[-1], self.surv[-1]
        if g >= t_last or s_g <= 0.0:
            return v * (max_new_tokens - g)
        target = s_g * (1.0 - v)
        if target < s_last:  # in the linear tail from (t_last, s_last) to (max_new_tokens, 0)
            return t_last + (1.0 - target / s_last) * max(0, max_new_tokens - t_last) - g
        # first event time after g where S drops to <= target (surv is non-increasing)
        lo, hi = k + 1, len(self.surv) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if self.surv[mid] <= target:
                hi = mid
            else:
                lo = mid + 1
        return self.times[lo] - g


class LengthPredictor:
    """E[L - g | L > g] for a request that has generated g tokens, from a mixture of
    (1) lengths of the same prompt (earlier RL iterations and finished siblings in this stage),
    (2) the stage's Kaplan-Meier survival (finished lengths, running requests censored), and
    (3) a prior: uniform between g and max_new_tokens.
    Components are weighted by how many observations exceed g, so the prior fades as data arrives."""

    def __init__(self, config: PredictorConfig | None = None) -> None:
        self.config = config or PredictorConfig()
        self._history: dict[str, list[int]] = {}
        self._finished: list[int] = []
        self._running: list[int] = []
        self._survival: _Survival | None = None
        self.version = 0  # bumped whenever an observation changes what a prediction can be (caches key on it)

    def start_stage(self) -> None:
        """Forget the previous stage's batch statistics (per-prompt history is kept)."""
        self.version += 1
        self._finished = []
        self._running = []
        self._survival = None

    def observe(self, prompt_key: str, final_length: int) -> None:
        """Record a final response length of `prompt_key` from an earlier iteration."""
        self.version += 1
        h = self._history.setdefault(prompt_key, [])
        h.append(final_length)
        del h[:-self.config.max_history_per_prompt]

    def observe_finished(self, prompt_key: str | None, final_length: int) -> None:
        """Record a request of the current stage that finished with `final_length` output tokens."""
        self.version += 1
        self._finished.append(final_length)
        self._survival = None
        if prompt_key is not None:
            self.observe(prompt_key, final_length)

    def set_running(self, num_output_tokens: Iterable[int]) -> None:
        """Generated counts of the running requests (censored observations for the stage distribution)."""
        self._running = list(num_output_tokens)
        self._survival = None

    def predict_remaining(self, g: int, max_new_tokens: int, prompt_key: str | None = None) -> int:
        """Predicted tokens still to generate, in [1, max_new_tokens - g]."""
        if g >= max_new_tokens:
            raise ValueError(f"num_output_tokens={g} must be < max_new_tokens={max_new_tokens}")
        cfg = self.config
        if self._survival is None:
            self._survival = _Survival(self._finished, self._running)
        num = cfg.prior_weight * (max_new_tokens - g) / 2.0
        den = cfg.prior_weight
        n_stage = min(self._survival.num_events_above(g), cfg.max_stage_weight)
        if n_stage > 0:
            num += n_stage * self._survival.mean_remaining(g, max_new_tokens)
            den += n_stage
        above = [x - g for x in self._history.get(prompt_key, ()) if x > g] if prompt_key is not None else []
        if above:
            num += cfg.prompt_weight * sum(above)
            den += cfg.prompt_weight * len(above)
        return max(1, min(max_new_tokens - g, round(num / den)))

    def sample_remaining(self, g: int, max_new_tokens: int, prompt_key: str | None, u: float) -> int:
        """A draw of the remaining tokens from the same mixture `predict_remaining` averages, at uniform `u` in
        [0, 1): `u` picks the component by its weight (prior, stage, same prompt), its position inside that
        component's share is the quantile taken there. Stratified `u` over a batch gives the batch the
        predicted spread, tail included, where the mean would give every request the same middle."""
        if g >= max_new_tokens:
            raise ValueError(f"num_output_tokens={g} must be < max_new_tokens={max_new_tokens}")
        cfg = self.config
        if self._survival is None:
            self._survival = _Survival(self._finished, self._running)
        n_stage = min(self._survival.num_events_above(g), cfg.max_stage_weight)
        above = sorted(x - g for x in self._history.get(prompt_key, ()) if x > g) if prompt_key is not None else []
        w_prompt = cfg.prompt_weight * len(above)
        x = u * (cfg.prior_weight + n_stage + w_prompt)
        if x < w_prompt:
            rem = above[min(len(above) - 1, int(x / w_prompt * len(above)))]
        elif x < w_prompt + n_stage:
            rem = self._survival.quantile_remaining(g, max_new_tokens, (x - w_prompt) / n_stage)
        else:
            rem = (x - w_prompt - n_stage) / cfg.prior_weight * (max_new_tokens - g)
        return max(1, min(max_new_tokens - g, round(rem)))
