from __future__ import annotations

import pytest

from pat_rollout.planner import LengthPredictor, PredictorConfig

M = 16384


def test_prior_without_data_is_uniform_to_max() -> None:
    p = LengthPredictor()
    assert p.predict_remaining(0, M) == M // 2
    assert p.predict_remaining(M - 1, M) == 1
    assert 1 <= p.predict_remaining(M - 3, M) <= 3


def test_prompt_history_is_used() -> None:
    p = LengthPredictor()
    for x in (1000, 1100, 900, 1000):
        p.observe("easy", x)
    for x in (15000, 16000):
        p.observe("hard", x)
    easy, hard = p.predict_remaining(0, M, "easy"), p.predict_remaining(0, M, "hard")
    assert easy < 2500 < 8000 < hard  # prior alone would be 8192 for both
    assert p.predict_remaining(0, M, "unknown") == M // 2


def test_conditioning_on_generated_tokens_is_consistent() -> None:
    p = LengthPredictor()
    for i in range(200):
        p.observe_finished(f"q{i % 25}", 200 + (i * 97) % 6000)
    p.set_running([5000, 7000, 9000])
    totals = []
    for g in range(0, M - 1, 250):
        r = p.predict_remaining(g, M, "q3")
        assert 1 <= r <= M - g
        totals.append(g + r)
    assert totals == sorted(totals)  # predicted final length never drops as the request keeps going
    # once past every observed length the long tail is uncertain: uniform to the cap
    assert p.predict_remaining(10000, M, "q3") == (M - 10000) // 2


def test_stage_distribution_learns_and_resets() -> None:
    p = LengthPredictor()
    for _ in range(100):
        p.observe_finished(None, 500)
    p.set_running([100] * 10)
    assert p.predict_remaining(100, M) < 1000
    p.start_stage()
    assert p.predict_remaining(100, M) == (M - 100) // 2


def test_deterministic() -> None:
    def run() -> list[int]:
        p = LengthPredictor()
        for i in range(50):
            p.observe_finished(f"k{i % 5}", (i * 131) % 4000 + 1)
        return [p.predict_remaining(g, M, f"k{g % 5}") for g in range(0, 5000, 100)]

    assert run() == run()


def test_draws_follow_the_mixture_the_mean_averages() -> None:
    """Stratified draws of `sample_remaining` spread over the same mixture `predict_remaining` averages: the prior
    alone is uniform to the cap, a prompt's history gives its lengths, and their mean is the prediction."""
    p = LengthPredictor()
    us = [(i + 0.5) / 1000 for i in range(1000)]
    prior = [p.sample_remaining(0, M, None, u) for u in us]
    assert prior == [max(1, round(u * M)) for u in us]  # the prior's quantiles: uniform on (0, M)
    for _ in range(8):
        p.observe("q", 3000)
    draws = [p.sample_remaining(1000, M, "q", u) for u in us]
    # weights: prompt 4 x 8 = 32 (every draw 2000), prior 2 (uniform on the 15384 tokens left)
    assert sum(d == 2000 for d in draws) == round(1000 * 32 / 34)
    assert sorted(draws)[-1] > 15000  # the prior's share is the tail
    assert sum(draws) / len(draws) == pytest.approx(p.predict_remaining(1000, M, "q"), rel=0.01)


def test_stage_survival_quantiles_condition_on_generated_tokens() -> None:
    p = LengthPredictor(PredictorConfig(prior_weight=1e-9))  # the stage alone (the prior only breaks ties)
    for n in (100, 200, 300, 400):
        for _ in range(25):
            p.observe_finished(None, n)
    p.set_running([])
    draws = sorted(p.sample_remaining(150, M, None, (i + 0.5) / 300) for i in range(300))
    # given L > 150 the stage's lengths are 200, 300, 400 with equal mass: remaining 50, 150, 250
    assert [draws[0], draws[150], draws[-1]] == [50, 150, 250]
    assert sum(d == 50 for d in draws) == pytest.approx(100, abs=2)
