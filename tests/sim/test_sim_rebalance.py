"""The simulator's rebalance action: requests move between replicas of the same layout by KV migration or
recomputation (the driver's hand-off rule), KV accounting stays exact, and the planner's rebalance decisions
become the action on a batch whose dispatch leaves every long request on one replica."""

from __future__ import annotations

import pytest
from profile_helpers import linear_profile

from pat_rollout.kv.cost import HandoffCost
from pat_rollout.planner import Planner, PlannerConfig
from pat_rollout.planner.rebalance import Move, plan_moves
from pat_rollout.sim import Rebalance, Sim, Trace, TraceRecord
from pat_rollout.sim.hardware import ref_cpu_hardware
from pat_rollout.sim.policies import PlannerPolicy, StaticPolicy

LONG, SHORT = 120, 6
PROMPTS = {0: 16, 2: 16, 4: 16, 6: 200}  # the long requests; r6's larger context changes its hand-off choice


def _trace() -> Trace:
    """8 requests; least-inflight dispatch alternates replicas, so the 4 long ones (even ids) all land on
    replica 0 (as bench/rebalance.py orders its batch)."""
    return Trace(name="imbalanced", records=tuple(
        TraceRecord(prompt_id=f"p{i}", prompt_len=PROMPTS.get(i, 16), response_len=LONG if i % 2 == 0 else SHORT)
        for i in range(8)), max_new_tokens=LONG)


def _hw():
    return ref_cpu_hardware(linear_profile(), tps=(1, 2), num_kv_blocks=64, block_size=16, steps_per_poll=4)


class TruthRebalancer:
    """Once only the long requests are left, rebalance by plan_moves on their true remaining lengths."""

    name = "truth-rebalance"

    def __init__(self) -> None:
        self.action: Rebalance | None = None

    def initial_tp(self) -> int:
        return 1

    def on_poll(self, view):
        if self.action is not None or view.num_unfinished > 4:
            return None
        reqs = view.state.requests
        moves = plan_moves([r.request_id for r in reqs], [r.replica for r in reqs],
                           [LONG - r.num_output_tokens for r in reqs], view.state.num_replicas)
        self.action = Rebalance(moves=moves)
        return self.action


def _run(policy, handoff: HandoffCost | None):
    hw = _hw()
    sim = Sim(hw, _trace(), num_devices=2, policy=policy, handoff=handoff)
    reqs = {r.rid: r for rep in sim.replicas for r in rep.waiting}
    assert {rid for rid, r in reqs.items() if r.length == LONG} == {"r0", "r2", "r4", "r6"}
    assert all(sim.where[rid] == 0 for rid in ("r0", "r2", "r4", "r6"))
    seen = []

    def check(s: Sim) -> bool:  # after every poll (and its action): KV accounting of each replica exact
        for rep in s.replicas:
            assert rep.used == sum(r.alloc for r in rep.running) <= rep.cap
        seen.append(dict(s.where))
        return False

    sim.run(stop=check)
    assert all(rep.used == 0 and not rep.busy for rep in sim.replicas)
    assert all(r.g == r.length for r in reqs.values())  # every request finished with its true length
    return sim, sim.result(policy.name), seen, reqs


# with 1024 KV bytes per token: migrate_s = 4e-3 + n * 1e-5 s, recompute_s = n * 5e-5 s: migration wins for
# n > 100 tokens of context
MIXED = HandoffCost(link_bytes_per_s=1.024e8, per_transfer_latency_s=4e-3, prefill_tokens_per_s=((1, 2e4), (2, 4e4)))


@pytest.mark.parametrize("handoff, migrated", [(None, set()), (MIXED, {"r6"})])
def test_rebalance_moves_plan_moves_choice_with_the_handoff_rule(handoff, migrated) -> None:
    pol = TruthRebalancer()
    sim, res, seen, reqs = _run(pol, handoff)
    # four equal long requests on replica 0: balance puts r2 and r6 on the other bin, and plan_moves keeps it
    assert pol.action.moves == (Move(request_id="r2", src=0, dst=1), Move(request_id="r6", src=0, dst=1))
    after = next(w for w in seen if w.get("r2") == 1)
    assert after == {"r0": 0, "r2": 1, "r4": 0, "r6": 1}
    assert res.num_rebalances == 1 and res.num_rebalanced == 2 and res.num_rebalance_migrated == len(migrated)
    assert res.num_reconfigs == 0 and res.schedule == ((0.0, 1),)
    # prefill: every prompt once, plus prompt + generated tokens of each recomputed (not migrated) request
    steps = _moved_at_steps(seen)
    assert steps == 8  # the short ones finish at step 6, inside the second poll of 4 steps
    recomputed = {"r2", "r6"} - migrated
    assert res.prefill_tokens == sum(r.prompt_len for r in reqs.values()) + sum(
        reqs[rid].prompt_len + steps for rid in recomputed)
    if handoff is not None:  # the rule itself: r6 (200 + g tokens) migrates, r2 (16 + g) recomputes
        assert sim.hw.kv_bytes_per_token == 1024
        assert handoff.choose_handoff(200 + steps, 1024, 1).method.is_migrate
        assert not handoff.choose_handoff(16 + steps, 1024, 1).method.is_migrate
    static = _run(StaticPolicy(1), handoff)[1]
    assert static.num_rebalances == 0 and res.latency_s < static.latency_s


def _moved_at_steps(seen: list[dict]) -> int:
    """Tokens the moved requests had generated when moved: the first poll with only 4 requests left."""
    i = next(k for k, w in enumerate(seen) if len(w) == 4)
    return 4 * (i + 1)  # steps_per_poll=4 per poll, one token per step from the first step


def test_rebalance_pause_is_the_kv_handoff_without_reshard() -> None:
    pol = TruthRebalancer()
    _, res, seen, reqs = _run(pol, MIXED)
    steps = _moved_at_steps(seen)
    rc = _hw().reconfig
    kv = (200 + steps) * _hw().kv_bytes_per_token  # only r6 migrates, onto replica 1's single device
    assert res.rebalance_s == pytest.approx(rc.fixed_s + rc.kv_latency_s + kv / rc.kv_bytes_per_s)
    assert res.overhead_s == pytest.approx(res.rebalance_s)


def test_rebalance_is_validated() -> None:
    with pytest.raises(ValueError, match="at least one move"):
        Rebalance(moves=())
    sim = Sim(_hw(), _trace(), num_devices=2, policy=StaticPolicy(1))
    with pytest.raises(ValueError, match="request 'r1' is on replica 1, not 0"):
        sim.apply(Rebalance(moves=(Move(request_id="r1", src=0, dst=1),)))
    with pytest.raises(ValueError, match="not unfinished"):
        sim.apply(Rebalance(moves=(Move(request_id="zz", src=0, dst=1),)))
    with pytest.raises(ValueError, match=r"replicas must lie in \[0, 2\)"):
        sim.apply(Rebalance(moves=(Move(request_id="r0", src=0, dst=2),)))


def test_planner_policy_turns_rebalance_decisions_into_the_action() -> None:
    cfg = PlannerConfig(candidate_tps=(1,), eval_every_steps=4, min_gain_s=0.0, min_steps_between_switches=8)
    out = {}
    for can in (False, True):
        pol = PlannerPolicy(Planner(linear_profile(), cfg), 1, can_rebalance=can)
        hw = _hw()
        out[can] = Sim(hw, _trace(), num_devices=2, policy=pol, handoff=MIXED).run().result("pat")
        assert pol.planner.can_rebalance is can
    assert out[False].num_rebalances == 0 and not out[False].decisions
    on = out[True]
    assert on.num_rebalances >= 1 and all(d.is_rebalance for d in on.decisions)
    assert on.num_rebalanced == sum(len(d.moves) for d in on.decisions)
    assert on.latency_s < out[False].latency_s


def test_sim_rebalance_row_on_a_gpu_profile() -> None:
    """bench.sim_rebalance's row: rebalance-only stays at the best static TP, regroup-only is sim_policies' pat
    (never rebalances), and the oracle bounds the regroup-only planner."""
    from pat_rollout.bench.sim_rebalance import row
    from pat_rollout.sim.compare import gpu_setup
    from pat_rollout.sim.traces import deepscaler_like

    hw, prof = gpu_setup("h100", "llama31_8b", "central")
    trace = deepscaler_like(num_prompts=16, samples_per_prompt=8, max_new_tokens=8192, seed=0)
    r = row(hw, prof, trace, num_devices=8)
    best_tp = int(r["static"].policy[len("static-tp"):])
    assert {tp for _, tp in r["rebalance"].schedule} == {best_tp}
    assert r["regroup"].num_rebalances == 0 and r["oracle"].num_rebalances == 0
    assert r["oracle"].latency_s <= min(r["static"].latency_s, r["regroup"].latency_s) + 1e-9
    for k in ("rebalance", "both"):
        assert r[k].num_rebalanced == sum(len(d.moves) for d in r[k].decisions if d.is_rebalance)


def test_rebalances_keep_shared_prefix_kv_exact_on_a_gpu_profile() -> None:
    """SGLang's scheduler shares a GRPO group's prompt KV: after every rebalance each replica holds its members'
    own tokens plus one prompt per group present, never above capacity, and nothing at the end."""
    from pat_rollout.kv.cost import handoff_cost
    from pat_rollout.sim.compare import gpu_setup
    from pat_rollout.sim.traces import deepscaler_like

    hw, prof = gpu_setup("h100", "llama31_8b", "central")
    trace = deepscaler_like(num_prompts=32, samples_per_prompt=8, max_new_tokens=8192, seed=0)
    pol = PlannerPolicy(Planner(prof, PlannerConfig(candidate_tps=(2,))), 2, trace, can_rebalance=True)
    sim = Sim(hw, trace, num_devices=8, policy=pol, handoff=handoff_cost(prof))
    reqs = [r for rep in sim.replicas for r in rep.waiting]

    def check(s: Sim) -> bool:
        for rep in s.replicas:
            prompts = {r.prompt_key: r.prompt_len for r in rep.running}
            assert set(prompts) == set(rep.groups)
            assert rep.used == sum(r.alloc for r in rep.running) + sum(prompts.values()) <= rep.cap
        return False

    res = sim.run(stop=check).result("pat")
    assert res.num_rebalances >= 1 and res.num_rebalance_migrated >= 1
    assert all(rep.used == 0 for rep in sim.replicas) and all(r.g == r.length for r in reqs)
