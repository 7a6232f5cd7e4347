"""`compat.reset_admission_state`: what every rank resets at a switch so the ranks of a new replica admit alike.

A stale `batch_is_full` on one rank of a grown replica (its TP1 replica had been full) made it skip a prefill the
other rank ran: their collectives no longer paired and CI hung (`test_sglang_pool_kv_room`). Here with SGLang's own
`ScheduleBatch` and, on 0.5.23, its `NewTokenRatioTracker` (0.5.12 keeps the ratio on the scheduler).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("sglang.srt")

from pat_rollout.sglang import compat  # noqa: E402

pytestmark = pytest.mark.sglang

INIT, DECAYED = 0.7, 0.35


def _scheduler(running_batch):
    """A scheduler's admission state as the installed SGLang keeps it: full running batch, decayed ratio."""
    try:
        from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker
    except ImportError:  # 0.5.12
        return SimpleNamespace(running_batch=running_batch, new_token_ratio=DECAYED, init_new_token_ratio=INIT)
    tracker = NewTokenRatioTracker(init=INIT, min=0.1, decay=0.01, current=DECAYED)
    return SimpleNamespace(running_batch=running_batch, new_token_ratio_tracker=tracker)


def test_reset_clears_batch_is_full_and_restores_the_initial_ratio():
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    sched = _scheduler(ScheduleBatch(reqs=[], batch_is_full=True))
    assert compat.admission_state(sched) == dict(batch_is_full=True, new_token_ratio=DECAYED)
    compat.reset_admission_state(sched)
    assert compat.admission_state(sched) == dict(batch_is_full=False, new_token_ratio=INIT)
    assert sched.running_batch.reqs == []  # the batch object is kept (SGLang holds references to it)


def test_reset_without_a_running_batch():
    sched = _scheduler(None)
    compat.reset_admission_state(sched)
    assert compat.admission_state(sched) == dict(batch_is_full=False, new_token_ratio=INIT)
