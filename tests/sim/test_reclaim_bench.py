"""bench.sim_reclaim's decision rule (#37 item 2) and the quick oracle's switch points (#39 item 3)."""

from __future__ import annotations

from pat_rollout.bench.sim_reclaim import bound_row, summarize
from pat_rollout.sim.policies import QUICK_ORACLE, fine_points, thresholds


def _row(pool_s: float, recl_s: float, pool_pre: int = 0, best_pre: int = 0) -> dict:
    return {"pool_s": pool_s, "reclaiming_s": recl_s, "best_static_s": 100.0, "reclaim_vs_pool": recl_s / pool_s,
            "pool_preempted": pool_pre, "best_static_preempted": best_pre}


def test_decision_rule(capsys) -> None:
    assert bound_row(_row(1, 1, pool_pre=3)) and bound_row(_row(1, 1, best_pre=1)) and not bound_row(_row(1, 1))
    # 4% better on the bound rows' median, nowhere 5%: pays (>= 3% median where some stage is capacity-bound)
    summarize([_row(100, 96, pool_pre=5), _row(100, 96, pool_pre=5), _row(100, 100)])
    assert "#37 decision: build reclaiming" in capsys.readouterr().out
    # 2% better on bound rows, 4% on the best row: below both bars
    summarize([_row(100, 98, pool_pre=5), _row(100, 98, pool_pre=5), _row(100, 96)])
    assert "#37 decision: do not build" in capsys.readouterr().out
    # one row 6% better, none bound: pays (>= 5% on any row)
    summarize([_row(100, 94), _row(100, 100)])
    assert "#37 decision: build reclaiming" in capsys.readouterr().out


def test_quick_oracle_points() -> None:
    assert thresholds(4096) == [2048, 1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1]
    assert thresholds(4096, QUICK_ORACLE["halvings"]) == [2048, 1024, 512, 256, 8, 4, 2, 1]
    assert fine_points(4096, QUICK_ORACLE["grid"], QUICK_ORACLE["halvings"]) == [
        3584, 3072, 2560, 2048, 1536, 1024, 512, 256, 8, 4, 2, 1]
