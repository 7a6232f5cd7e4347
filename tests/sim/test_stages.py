"""Several RL steps per benchmark row, one planner carried across them (issue #24 item 3)."""

from __future__ import annotations

import pytest

from pat_rollout.planner import PlannerConfig
from pat_rollout.sim.compare import compare, compare_stages, gpu_setup
from pat_rollout.sim.traces import deepscaler_like, rl_stages


def test_rl_stages_are_fresh_draws_of_the_same_prompts_ending_with_the_trace() -> None:
    tr = deepscaler_like(num_prompts=4, max_new_tokens=4096, seed=1, history_iters=3)
    stages = rl_stages(tr, 3)
    assert len(stages) == 3 and stages[-1].records == tr.records
    k = len(tr.records)  # 4 prompts x 8 samples
    assert stages[0].records == tr.history[k:2 * k] and stages[1].records == tr.history[2 * k:3 * k]
    for prev, cur in zip(stages, stages[1:]):
        assert cur.history == prev.records and cur.records != prev.records
        assert [r.prompt_id for r in cur.records] == [r.prompt_id for r in prev.records]
    assert stages[0].history == tr.history[:k]
    more = rl_stages(tr, 5)  # short of draws: the earliest stage repeats
    assert more[0] == more[1] == stages[0] and more[2:] == stages
    with pytest.raises(ValueError):
        rl_stages(tr, 0)


def test_compare_stages_carries_one_planner_and_scores_first_and_steady_stage() -> None:
    hw, model = gpu_setup("h100", "llama31_8b", "central")
    stages = rl_stages(deepscaler_like(num_prompts=16, max_new_tokens=4096, seed=3, history_iters=3), 3)
    cfg = PlannerConfig(candidate_tps=(1, 2, 4, 8))
    run = compare_stages(hw, model, stages, num_devices=8, planner_config=cfg, with_oracle=False,
                         with_lookahead=True)
    fresh = compare(hw, model, stages[0], num_devices=8, planner_config=cfg, with_oracle=False, with_lookahead=True)
    assert run.first.by()["pat"].latency_s == fresh.by()["pat"].latency_s  # the first stage: a fresh planner
    assert {r.policy for r in run.steady.results} >= {"static-tp1", "static-tp8", "pat", "pat-lookahead"}
    la = run.planners["pat-lookahead"]
    assert len(la.margin.stage_errors) == 2  # stages 1 and 2 ended on this planner: it was carried
    assert la.calibration.observed_tps()  # and its calibration with them
