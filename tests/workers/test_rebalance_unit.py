"""Rebalance pieces that need no actors: pool capability flags, move validation, stage metrics."""

from __future__ import annotations

import pytest

from pat_rollout.driver.metrics import StageMetrics
from pat_rollout.layout import Layout
from pat_rollout.workers.pool import Pool, RefPool
from pat_rollout.workers.rebalance import check_moves


def test_only_the_reference_pool_rebalances() -> None:
    from pat_rollout.sglang.pool import SglPool  # imports without sglang; its engine is started in __init__

    assert RefPool.supports_rebalance and not Pool.supports_rebalance and not SglPool.supports_rebalance
    with pytest.raises(NotImplementedError, match="SglPool cannot rebalance yet"):
        SglPool.rebalance(object.__new__(SglPool), {"a": 1}, {"a": 0})


def test_check_moves_names_the_bad_move() -> None:
    layout = Layout.uniform(4, 2)
    check_moves(layout, {"a": 1}, {"a": 0, "b": 1})
    with pytest.raises(ValueError, match="request 'c' is not unfinished"):
        check_moves(layout, {"c": 1}, {"a": 0})
    with pytest.raises(ValueError, match=r"request 'a' on replica 0 cannot move to replica 2 of .* \(2 replicas\)"):
        check_moves(layout, {"a": 2}, {"a": 0})
    with pytest.raises(ValueError, match="request 'a' on replica 0 cannot move to replica 0"):
        check_moves(layout, {"a": 0}, {"a": 0})


def test_stage_metrics_rebalance_and_finish_spread() -> None:
    m = StageMetrics()
    m.record_layout("2xTP1")
    m.record_rebalance({"export": 0.5, "import": 0.25}, num_moved=3, num_migrated=2, num_recomputed=1)
    m.record_rebalance({"export": 0.5}, num_moved=1, num_migrated=0, num_recomputed=1)
    m.replica_finish_s.update({0: 10.0, 1: 13.5})
    d = m.as_dict()
    assert (d["pat/num_rebalances"], d["pat/num_rebalanced"], d["pat/num_migrated"], d["pat/num_recomputed"]) == (
        2, 4, 2, 2)
    assert d["pat/rebalance_export_s"] == 1.0 and d["pat/rebalance_import_s"] == 0.25
    assert d["pat/replica_finish_spread_s"] == 3.5
    m.record_layout("1xTP2")  # a regroup: the spread is over the replicas of the new layout
    assert m.as_dict()["pat/replica_finish_spread_s"] == 0.0
