"""The planner drives the real engine pool: with a profile in which TP2 wins once the batch drains,
PAT switches 2xTP1 -> 1xTP2 by itself mid-stage, and outputs equal a static run."""

from __future__ import annotations

import pytest
from pool_helpers import pool_config, skewed_requests

from pat_rollout.driver import RolloutDriver
from pat_rollout.sim.policies import ReplayPolicy

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# Mid-stage switching on the hand-made profile alone: no starting-layout choice, no correction from measured times.
PLANNER = {"eval_every_steps": 2, "min_steps_between_switches": 2, "min_gain_s": 0.0, "min_gain_ratio": 0.0,
           "start_layout": False, "calibrate": False}


def test_planner_reconfigures_when_batch_drains(ray_cluster, tiny_models, tiny_profile):
    requests = skewed_requests(n=8, long_len=64)
    static = RolloutDriver(pool_config(tiny_models["llama"], policy="static"))
    try:
        reference = static.generate(requests, timeout=300)
    finally:
        static.shutdown()
    driver = RolloutDriver(pool_config(tiny_models["llama"], policy="pat", profile_path=tiny_profile,
                                       planner=PLANNER))
    try:
        outputs = driver.generate(requests, timeout=300)
        metrics = driver.stage_metrics()
        second = driver.generate(requests[:3], timeout=300)  # a new stage starts again from the base layout
        metrics2 = driver.stage_metrics()
    finally:
        driver.shutdown()
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    assert metrics["pat/num_reconfigs"] >= 1, metrics
    layouts = metrics["pat/layouts"]
    assert layouts.startswith("2xTP1") and "1xTP2" in layouts, layouts
    # the same decisions by poll, in the form the simulator replays (sim.policies.ReplayPolicy)
    by_poll = metrics["pat/layout_polls"]
    assert [p.split("@")[0] for p in by_poll.split(" -> ")] == [p.split("@")[0] for p in layouts.split(" -> ")]
    replay = ReplayPolicy.from_layout_polls(by_poll)
    assert replay.layouts[0] == (0, 1) and replay.layouts[1][1] == 2
    assert replay.layouts[1][0] >= 1  # mid-stage (no start-layout choice here): after at least one poll
    assert metrics["pat/tail_time_after_switch_s"] > 0
    assert metrics2["pat/layouts"].startswith("2xTP1"), metrics2
    assert [o.token_ids for o in second] == [o.token_ids for o in reference[:3]]


def test_planner_stays_when_overhead_exceeds_benefit(ray_cluster, tiny_models, tmp_path):
    from pool_helpers import write_profile

    # TP1 is the fast layout in this profile: switching can only lose, so PAT must not reconfigure.
    profile = write_profile(tmp_path / "tp1_fast.json", fast_tp=1)
    driver = RolloutDriver(pool_config(tiny_models["llama"], policy="pat", profile_path=profile, planner=PLANNER))
    try:
        driver.generate(skewed_requests(n=6, long_len=32), timeout=300)
        metrics = driver.stage_metrics()
    finally:
        driver.shutdown()
    assert metrics["pat/num_reconfigs"] == 0, metrics


def test_unknown_planner_option_is_rejected(tiny_models, tiny_profile):
    with pytest.raises(ValueError, match=r"unknown planner option\(s\) \['bogus'\]"):
        RolloutDriver(pool_config(tiny_models["llama"], policy="pat", profile_path=tiny_profile,
                                  planner={"bogus": 1}))


def test_stage_starts_in_the_layout_its_batch_favours_and_reports_calibration(ray_cluster, tiny_models,
                                                                              tiny_profile):
    from pat_rollout.planner.calibration import PollSample, ReconfigSample

    # The hand-made profile: TP2 wins 1-2 requests, 2 x TP1 wins 8. Calibration records but does not correct, so
    # the choices follow the profile whatever this machine's timings.
    planner = {**PLANNER, "start_layout": True}
    few, many = skewed_requests(n=2, long_len=24), skewed_requests(n=8, long_len=8, short_len=6, seed=1)
    static = RolloutDriver(pool_config(tiny_models["llama"], policy="static"))
    try:
        reference = static.generate(few, timeout=300) + static.generate(many, timeout=300)
    finally:
        static.shutdown()
    driver = RolloutDriver(pool_config(tiny_models["llama"], policy="pat", profile_path=tiny_profile,
                                       planner=planner))
    try:
        outputs = driver.generate(few, timeout=300)
        m1 = driver.stage_metrics()
        outputs += driver.generate(many, timeout=300)
        m2 = driver.stage_metrics()
        samples = list(driver.samples)
    finally:
        driver.shutdown()
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    first = [step.split("[")[0] for step in m1["pat/layouts"].split(" -> ")]
    assert first == ["2xTP1", "1xTP2"] and m1["pat/num_reconfigs"] == 1, m1
    assert m1["pat/num_migrated"] + m1["pat/num_recomputed"] == 0  # switched before dispatch: nothing handed off
    second = [step.split("[")[0] for step in m2["pat/layouts"].split(" -> ")]
    assert second[:2] == ["1xTP2", "2xTP1"], m2  # shrinks for the bigger batch, before dispatching it
    assert m1["pat/calibration_polls"] >= 1 and m1["pat/profile_error"] > 0 and "pat/calibrated_error" in m1
    assert m1["pat/overhead_error_s"] >= 0 and "pat/overhead_bias_tp1_tp2_s" in m1 and m1["pat/start_explored"] == 0
    assert {(s.tp_src, s.tp_dst) for s in samples if isinstance(s, ReconfigSample)} == {(1, 2), (2, 1)}
    polls = [s for s in samples if isinstance(s, PollSample)]
    assert {s.tp for s in polls} == {1, 2} and all(s.num_steps == 2 for s in polls)
