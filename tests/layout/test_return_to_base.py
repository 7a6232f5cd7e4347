"""Any sequence of switches can return to the pool's base layout exactly (pure layout layer).

Weight updates, rollback and every stage start need the base layout itself, not the base groups in
another replica or rank order, and every layout visited must be one whose groups are built at start-up.
"""

from __future__ import annotations

import random

import pytest
from transition_cases import specs_for

from pat_rollout.layout import Layout, plan_layout, plan_weights
from pat_rollout.layout.reachable import reachable_layouts
from pat_rollout.layout.transition import bytes_moved


def test_grow_twice_then_shrink_lands_on_base() -> None:
    base = Layout.uniform(4, 1)
    tp4 = plan_layout(plan_layout(base, 2, base=base), 4, base=base)
    assert tp4 == Layout(((0, 2, 1, 3),))
    assert plan_layout(tp4, 4) != base and plan_layout(tp4, 1) == Layout(((0,), (2,), (1,), (3,)))  # the old bug
    assert plan_layout(tp4, 1, base=base) == base


def test_base_must_cover_the_same_devices() -> None:
    with pytest.raises(ValueError, match=r"base .* covers devices \(0, 1\), src .* covers \(0, 1, 2, 3\)"):
        plan_layout(Layout.uniform(4, 2), 1, base=Layout.uniform(2, 1))


@pytest.mark.parametrize("num_devices", [2, 4, 8])
def test_random_switch_sequences_return_to_base(num_devices: int) -> None:
    specs = specs_for("llama_gqa2")  # max_tp 8: every power of two up to 8 shards it
    tps = [tp for tp in (1, 2, 4, 8) if num_devices % tp == 0]
    rng = random.Random(num_devices)
    for base_tp in tps:
        base = Layout.uniform(num_devices, base_tp)
        reachable = reachable_layouts(base, tps)
        for _ in range(60):
            cur = base
            for _ in range(rng.randrange(1, 7)):
                tp = rng.choice([t for t in tps if t != cur.tp_size] or tps)
                nxt = plan_layout(cur, tp, base=base)
                assert nxt.tp_size == tp and nxt in reachable, f"{cur} -> TP{tp} gives unbuilt {nxt}"
                cur = nxt
            back = plan_layout(cur, base_tp, base=base)
            assert back == base, f"{cur} -> TP{base_tp} gives {back}, not the base {base}"
            # Where the plain rule lands on the base groups in another replica order, the base costs nothing more.
            rule = plan_layout(cur, base_tp)
            if set(rule.groups) == set(base.groups):
                assert bytes_moved(plan_weights(cur, back, specs), 2) == bytes_moved(plan_weights(cur, rule, specs), 2)
