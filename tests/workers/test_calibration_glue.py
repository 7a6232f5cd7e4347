"""What the driver feeds the planner's calibration from one poll, and where its metrics appear (no Ray)."""

from __future__ import annotations

import dataclasses

from pat_rollout.driver.metrics import StageMetrics
from pat_rollout.driver.planner_glue import poll_sample
from pat_rollout.engine.base import EngineSnapshot, RunningInfo, StepResult
from pat_rollout.types import RequestOutput


def _result(num_steps: int, decoded: int, running: list[tuple[int, int]], prefill: int = 0):
    infos = tuple(RunningInfo(request_id=f"r{i}", num_prompt_tokens=p, num_output_tokens=o, max_new_tokens=500)
                  for i, (p, o) in enumerate(running))
    return (StepResult(finished=(), num_steps=num_steps, num_decode_tokens=decoded, num_prefill_tokens=prefill,
                       num_running=len(infos), num_waiting=0, elapsed_s=0.1),
            EngineSnapshot(running=infos, num_waiting=0, num_free_blocks=1, num_total_blocks=2, block_size=16))


def test_poll_sample_mean_batch_and_mid_poll_context() -> None:
    # replica 0: 3 then 2 requests over 4 steps (10 tokens: one finished after 2 steps); replica 1: 1 request.
    s = poll_sample(1, {0: _result(4, 10, [(20, 40), (10, 30)]), 1: _result(4, 4, [(8, 100)])}, 0.2)
    assert s is not None and s.tp == 1 and s.num_steps == 4 and s.elapsed_s == 0.2
    assert s.replicas == ((2.5, 48.0), (1.0, 106.0))  # contexts: mean at the end minus half the poll's steps


def test_poll_sample_skips_prefill_and_drained_replicas() -> None:
    assert poll_sample(2, {0: _result(4, 8, [(20, 40)], prefill=20)}, 0.2) is None
    assert poll_sample(2, {0: _result(4, 8, [(20, 40), (9, 3)])}, 0.2) is None  # r1 started in this poll
    s = poll_sample(1, {0: _result(4, 4, [(20, 40)]), 1: _result(2, 2, [])}, 0.2)  # replica 1 drained mid-poll
    assert s is not None and s.replicas == ((1.0, 58.0),)
    assert poll_sample(1, {0: _result(0, 0, [])}, 0.2) is None


def test_poll_sample_skips_polls_that_finished_a_request() -> None:
    step, snap = _result(4, 6, [(20, 40)])
    done = RequestOutput(request_id="r9", prompt_token_ids=(1, 2), token_ids=(3, 4), log_probs=(0.0, 0.0),
                         finish_reason="length")
    assert poll_sample(1, {0: (dataclasses.replace(step, finished=(done,)), snap)}, 0.2) is None
    assert poll_sample(1, {0: (step, snap)}, 0.2) is not None


def test_planner_metrics_reach_the_stage_dict() -> None:
    m = StageMetrics()
    m.planner = {"pat/profile_error": 0.25, "pat/calibrated_error": 0.05}
    d = m.as_dict()
    assert d["pat/profile_error"] == 0.25 and d["pat/calibrated_error"] == 0.05 and "pat/gen_time_s" in d
