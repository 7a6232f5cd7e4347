from __future__ import annotations

from pat_rollout.planner import LengthPredictor

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
