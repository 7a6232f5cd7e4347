"""Reliability rules that need no actors: timeouts are validated, planner options are checked under every
policy, and a failed planner switch is cancelled in the planner."""

from __future__ import annotations

import math

import pytest
from pool_helpers import pool_config

from pat_rollout.driver import RolloutDriver
from pat_rollout.driver.metrics import StageMetrics
from pat_rollout.layout import Layout
from pat_rollout.planner import Decision
from pat_rollout.workers.reconfigure import ReconfigurationError


@pytest.mark.parametrize("name", ["comm_timeout_s", "rpc_timeout_s", "rpc_timeout_per_token_s",
                                  "transfer_timeout_floor_s", "transfer_min_bytes_per_s"])
@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, "5"])
def test_timeouts_must_be_finite_and_positive(name, value):
    with pytest.raises(ValueError, match=f"{name}="):
        pool_config("unused", **{name: value})


def test_rpc_deadline_grows_with_work_above_the_floor():
    cfg = pool_config("unused", comm_timeout_s=3, rpc_timeout_s=2, rpc_timeout_per_token_s=0.5)
    assert cfg.rpc_deadline_s() == 5 and cfg.rpc_deadline_s(10) == 10


@pytest.mark.parametrize("policy", ["static", "manual", "pat"])
def test_unknown_planner_options_fail_under_every_policy(tiny_models, tiny_profile, policy):
    with pytest.raises(ValueError, match=r"unknown planner option\(s\) \['bogus'\]"):
        RolloutDriver(pool_config(tiny_models["llama"], policy=policy, profile_path=tiny_profile,
                                  planner={"bogus": 1}))


class _Planner:
    def __init__(self, decision: Decision) -> None:
        self.decision = decision
        self.cancelled: list[Decision] = []

    def decide(self, state):
        return self.decision

    def cancel(self, decision: Decision) -> None:
        self.cancelled.append(decision)


class _FailingPool:
    layout = base = Layout.uniform(2, 1)
    kv_tokens = None
    reports_load = False

    def entry_cost_s(self, tp):
        return 0.0

    def reconfigure(self, dst_tp, assignment):
        raise ReconfigurationError("injected", dict(assignment))


def test_failed_planner_switch_is_cancelled():
    decision = Decision(step=8, source_tp=1, target_tp=2, predicted_remaining_now_s=2.0,
                        predicted_remaining_target_s=1.0, predicted_overhead_s=0.1, reason="test")
    driver = RolloutDriver.__new__(RolloutDriver)  # the decision path only; no actors
    driver.config = pool_config("unused")
    driver.pool, driver.planner, driver._stage = _FailingPool(), _Planner(decision), StageMetrics()
    driver._num_polls, driver._requests, driver._progress, driver._prompt_keys = 1, {}, {}, {}
    driver._assignment, driver._snapshots, driver._engine_spec = {"r0": 1}, {}, None
    driver._maybe_reconfigure()
    assert driver.planner.cancelled == [decision]  # so hysteresis and the stage cap count only real switches
    assert driver._assignment == {"r0": 1} and driver._stage.num_failed_reconfigs == 1
