"""The planner's lookahead against the simulator's truth on a capacity-bound stage (TP1 preempts), and PAT with
the lookahead estimator (PlannerConfig.estimator="lookahead") against the oracle there. The lookahead runs the same
engine mechanics (planner/engine_model.py) on the planner's profile (the central published-figure profile; the truth
is the central formula), so fed the true lengths it must agree with the simulator; the remaining error is the
profile's grid, the bundling of requests into units and the chunking."""

from __future__ import annotations

import dataclasses

import pytest

from pat_rollout.kv.cost import handoff_cost
from pat_rollout.planner import PlannerConfig
from pat_rollout.planner.lookahead import LookaheadConfig, build
from pat_rollout.sim.compare import compare, engine_spec, gpu_setup
from pat_rollout.sim.policies import StaticPolicy, run_policy
from pat_rollout.sim.simulator import Reconfigure, Sim
from pat_rollout.sim.traces import deepscaler_like

TPS = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def setup():
    # 384 requests at 0.35 of an H100: TP1 replicas hold 76k KV tokens and preempt, the reserve throttles TP2
    hw, prof = gpu_setup("h100", "llama31_8b", "central", mem_fraction=0.35)
    trace = deepscaler_like(num_prompts=48, samples_per_prompt=8, max_new_tokens=8192, seed=0)
    return hw, prof, trace


def _lookahead(hw, prof, state, true_remaining):
    return build(step=prof, spec=engine_spec(hw), num_devices=8, requests=state.requests,
                 draw=lambda r, u: true_remaining[r.request_id], config=LookaheadConfig(),
                 migrates=lambda n, tp: handoff_cost(prof).choose_handoff(n, prof.model.kv_bytes_per_token(),
                                                                           tp).method.is_migrate)


def test_lookahead_agrees_with_the_simulator_within_5_percent(setup) -> None:
    hw, prof, trace = setup
    statics = {tp: run_policy(hw, trace, StaticPolicy(tp), num_devices=8) for tp in TPS}
    assert statics[1].num_preempted > 0  # capacity-bound
    # a stage not started: dispatch, admission with the reserve, preemption, prefill with prefix sharing
    sim = Sim(hw, trace, num_devices=8, policy=StaticPolicy(1))
    state = sim._cluster_state()
    true = {r.rid: r.length - r.g for rep in sim.replicas for r in (*rep.running, *rep.waiting)}
    # the batch as the planner sees it before dispatch (driver.planner_glue.start_state): no replicas yet
    la = _lookahead(hw, prof, dataclasses.replace(state, requests=tuple(
        dataclasses.replace(p, replica=None) for p in state.requests)), true)
    for tp in TPS:
        assert la.stay_s(tp) == pytest.approx(statics[tp].latency_s, rel=0.05), tp
    # mid-stage at TP1 (some requests preempted, the rest running): staying, and regrouping to TP4
    sim.run(stop=lambda s: s.num_unfinished <= 250)
    state = sim._cluster_state()
    assert any(r.cached is False and r.num_output_tokens > 0 for r in state.requests)  # preempted, waiting
    true = {r.rid: r.length - r.g for rep in sim.replicas for r in (*rep.running, *rep.waiting)}
    la = _lookahead(hw, prof, state, true)
    t0 = max([sim.t, *(rep.t for rep in sim.replicas)])
    stay = sim.clone().run().result("x").latency_s - t0
    assert la.stay_s(1) == pytest.approx(stay, rel=0.05)
    regroup = sim.clone()
    regroup.handoff = handoff_cost(prof)
    regroup.apply(Reconfigure(tp=4))
    after = regroup.run().result("x")
    pause = after.overhead_s
    assert la.regroup_s(4)[0] == pytest.approx(after.latency_s - t0 - pause, rel=0.05)


def test_pat_within_2_percent_of_the_oracle_on_a_capacity_bound_stage(setup) -> None:
    hw, prof, trace = setup
    cmp = compare(hw, prof, trace, num_devices=8,
                  planner_config=PlannerConfig(candidate_tps=TPS, estimator="lookahead"))
    by = cmp.by()
    # PAT and the oracle run on the pool's room (#37), the statics on a stock engine's: compare like with like
    pool_statics = [run_policy(hw.pool(), trace, StaticPolicy(tp), num_devices=8).latency_s for tp in TPS]
    assert by["oracle"].latency_s <= min(pool_statics) + 1e-9
    assert by["pat"].latency_s <= 1.02 * by["oracle"].latency_s
    assert by["pat"].latency_s <= 1.01 * min(pool_statics)
