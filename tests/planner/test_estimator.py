from __future__ import annotations

import pytest

from pat_rollout.planner import balance, drain_s, replica_drain_s, transition_cost
from pat_rollout.profile.model import LatencyModel


@pytest.fixture(scope="module")
def h100() -> LatencyModel:
    return LatencyModel.from_json("h100_llama31_8b")


def test_chunked_integral_matches_per_step_sum(h100: LatencyModel) -> None:
    rem, tok = [5, 300, 301, 2000], [100, 5000, 40, 900]
    naive, live = 0.0, list(zip(rem, tok))
    for s in range(max(rem)):
        live = [(r, n) for r, n in live if r > s]
        naive += h100.decode_step_s(2, len(live), sum(n + s + 0.5 for _, n in live) / len(live))
    assert replica_drain_s(h100, 2, rem, tok) == pytest.approx(naive, rel=1e-3)


def test_drain_monotone(h100: LatencyModel) -> None:
    base = dict(tp=2, num_devices=8, num_tokens=[200] * 64)
    t0 = drain_s(h100, remaining=[1000] * 64, **base)
    assert drain_s(h100, remaining=[1000] * 63 + [3000], **base) > t0
    assert drain_s(h100, remaining=[2000] * 64, **base) > t0
    assert drain_s(h100, tp=2, num_devices=8, remaining=[1000] * 128, num_tokens=[200] * 128) > t0
    # one long request: the bigger the TP, the sooner it drains
    one = [drain_s(h100, tp=tp, num_devices=8, remaining=[8000], num_tokens=[200]) for tp in (1, 2, 4, 8)]
    assert one == sorted(one, reverse=True)


def test_balance_is_deterministic_and_even() -> None:
    loads = [10, 9, 8, 1, 1, 1, 1, 1]
    a = balance(loads, 2)
    assert a == balance(loads, 2)
    sums = [sum(x for x, r in zip(loads, a) if r == k) for k in range(2)]
    assert abs(sums[0] - sums[1]) <= 2


def test_transition_cost(h100: LatencyModel) -> None:
    grow = transition_cost(h100, num_devices=8, tp_src=1, tp_dst=8, num_tokens=[1000] * 10)
    shrink = transition_cost(h100, num_devices=8, tp_src=8, tp_dst=1, num_tokens=[1000] * 10)
    assert grow.reshard_s == 0.0 and shrink.reshard_s > 0.0
    assert grow.num_migrated == 10 and grow.switch_s == h100.group_switch_s
    assert transition_cost(h100, num_devices=8, tp_src=2, tp_dst=2, num_tokens=[1000]).total_s == 0.0
