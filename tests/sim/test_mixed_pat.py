"""Mixed PAT (issue #26): planner.mixed.MixedPlanner over buddy layouts, and its simulator driver sim.mixed_pat."""

from __future__ import annotations

import dataclasses

import pytest

from pat_rollout.kv.cost import handoff_cost
from pat_rollout.planner import Planner, PlannerConfig, ReqProgress
from pat_rollout.planner.calibration import ReconfigSample
from pat_rollout.planner.mixed import BuddyDecision, MixedPlanner, MixedState, longest_moves
from pat_rollout.profile.model import LatencyModel
from pat_rollout.sim.buddy import Merge, MixedSim, Split
from pat_rollout.sim.compare import gpu_setup
from pat_rollout.sim.mixed_pat import MixedPlannerPolicy, run_mixed_pat
from pat_rollout.sim.policies import StaticPolicy
from pat_rollout.sim.simulator import Reconfigure
from pat_rollout.sim.traces import Trace, TraceRecord

M = 16384
TPS = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def h100() -> LatencyModel:
    return LatencyModel.from_json("h100_llama31_8b")


def _planner(model: LatencyModel, tps: tuple[int, ...] = TPS) -> Planner:
    p = Planner(model, PlannerConfig(candidate_tps=tps, estimator="drain"))  # MixedPlanner's estimator
    for _ in range(8):  # earlier iterations: "long" runs ~12k tokens, "short" ~2k
        p.observe_history("long", 12000)
        p.observe_history("short", 2000)
    return p


def _state(blocks: list[tuple[int, int]], per_block: list[tuple[int, str, int, int]], step: int = 5000) -> MixedState:
    """per_block[k] = (count, prompt key, generated tokens, prompt tokens) of the requests on block k."""
    reqs = [ReqProgress(request_id=f"{k}-{key}{i}", prompt_key=key, num_prompt_tokens=prompt, num_output_tokens=g,
                        max_new_tokens=M, replica=k)
            for k, (n, key, g, prompt) in enumerate(per_block) for i in range(n)]
    return MixedState(step=step, num_devices=sum(size for _, size in blocks), blocks=tuple(blocks),
                      requests=tuple(reqs))


TP1X8 = [(i, 1) for i in range(8)]
SHORTS = (32, "short", 1000, 8000)  # many short requests with long prompts: pausing or re-prefilling them costs


def test_mixed_state_checks_its_layout() -> None:
    assert _state([(0, 4), (4, 2), (6, 2)], [(1, "long", 10, 10)] * 3).tp == 0
    assert _state([(0, 2), (2, 2)], [(1, "long", 10, 10)] * 2).uniform().tp == 2
    with pytest.raises(ValueError, match="tiling"):
        _state([(0, 2), (2, 4)], [(1, "long", 10, 10)] * 2)  # (2, 4) is not aligned
    with pytest.raises(ValueError, match="block index"):
        MixedState(step=0, num_devices=2, blocks=((0, 2),), requests=(
            ReqProgress(request_id="x", prompt_key=None, num_prompt_tokens=1, num_output_tokens=0, max_new_tokens=4),))


@pytest.mark.parametrize("case", ["grow", "stay-full", "shrink"])
def test_on_a_uniform_only_situation_it_makes_uniform_pats_choice(h100: LatencyModel, case: str) -> None:
    """No buddy action pays here (every block has the same work, or the pool is two blocks), so mixed PAT answers
    exactly what the uniform planner answers, to the same Decision record."""
    state = {"grow": _state(TP1X8, [(1, "long", 2000, 200)] * 8),
             "stay-full": _state(TP1X8, [(128, "short", 100, 200)] * 8, step=100),
             "shrink": _state([(0, 4), (4, 4)], [(512, "short", 100, 200)] * 2, step=100)}[case]
    uniform = _planner(h100).decide(state.uniform())
    mixed = MixedPlanner(_planner(h100))
    assert mixed.decide(state) == uniform
    assert (uniform is None) == (case == "stay-full")
    assert not mixed.actions


def test_it_finds_the_merge_of_the_two_blocks_holding_the_long_requests(h100: LatencyModel) -> None:
    """Two long requests alone on TP1 blocks 0 and 1, many short ones with long prompts on the other six: merging
    the pair gives the long ones TP2 while the short ones keep decoding; any uniform regroup pauses and re-places
    the short ones, and a larger TP serves them less efficiently. The uniform planner would regroup."""
    state = _state(TP1X8, [(1, "long", 2000, 200)] * 2 + [SHORTS] * 6)
    uniform = _planner(h100).decide(state.uniform())
    assert uniform is not None and uniform.action == "regroup"
    mixed = MixedPlanner(_planner(h100))
    d = mixed.decide(state)
    assert isinstance(d, BuddyDecision) and (d.action, d.start, d.size, d.pull, d.push) == ("merge", 0, 1, (), ())
    assert d.predicted_saving_s > uniform.predicted_saving_s
    assert mixed.planner.switches == []  # the uniform planner's switch was cancelled, not recorded
    assert mixed.actions == [(5000, "merge", (0, 2))]  # the block it made


def test_it_pulls_the_long_request_into_the_merged_group(h100: LatencyModel) -> None:
    """The long requests sit on blocks 0 and 2 (not buddies): a merge pays only by pulling the other long one in,
    and swapping the merged pair's short ones out."""
    state = _state(TP1X8, [(1, "long", 2000, 200), SHORTS, (1, "long", 2000, 200)] + [SHORTS] * 5)
    d = MixedPlanner(_planner(h100)).decide(state)
    assert isinstance(d, BuddyDecision) and d.action == "merge" and d.size == 1 and d.start in (0, 2)
    other = "2-long0" if d.start == 0 else "0-long0"
    assert other in d.pull and d.push
    assert {rid for rid, _ in d.push} <= {r.request_id for r in state.requests if r.replica in (d.start, d.start + 1)}
    assert all(dst not in (d.start, d.start + 1) for _, dst in d.push)


def test_longest_moves_ranks_by_the_remaining_tokens_it_is_given() -> None:
    blocks = [(0, 1), (1, 1), (2, 1), (3, 1)]
    items = [("a", 0, 10.0, 5), ("b", 1, 1.0, 50), ("c", 2, 90.0, 5), ("d", 3, 80.0, 5), ("e", 2, 2.0, 7)]
    pull, push = longest_moves(blocks, items, 0, 1, 4, share=1.0)  # top ceil(5 * 2 / 4) = 3: c, d, a
    assert pull == ("c", "d") and push == (("b", 3),)  # to the block with the fewest context tokens left (d left 3)
    # top 1: c; the pair's others out, longest context first: b (50) to block 3 (d: 5 < e: 7), then a to block 2
    assert longest_moves(blocks, items, 0, 1, 4, share=0.25) == (("c",), (("a", 2), ("b", 3)))


def test_no_immediate_undo_and_the_buddy_cap(h100: LatencyModel) -> None:
    state = _state(TP1X8, [(1, "long", 2000, 200)] * 2 + [SHORTS] * 6)
    mixed = MixedPlanner(_planner(h100))
    assert isinstance(mixed.decide(state), BuddyDecision)
    merged = _state([(0, 2)] + TP1X8[2:], [(2, "long", 2000, 200)] + [SHORTS] * 6, step=5000 + 64)
    split = next(o for o in mixed.options(merged)[1] if o.action == "split")
    assert "min_steps_between_switches" in mixed._why_not(merged, split)
    later = dataclasses.replace(merged, step=5000 + 300)
    assert "no_return_steps" in mixed._why_not(later, split)
    mixed.actions += [(0, "merge", (4, 2))] * 2
    assert "max_reconfigs_per_stage" in mixed._why_not(later, split)


def _trace(long_len: int) -> Trace:
    """Two long requests (dispatched to replicas 0 and 1) among 190 short ones with 6000-token prompts."""
    recs = [TraceRecord(prompt_id="long", prompt_len=200, response_len=long_len) for _ in range(2)]
    recs += [TraceRecord(prompt_id=f"s{i % 16}", prompt_len=6000, response_len=600 + (i * 37) % 800)
             for i in range(2, 192)]
    hist = [TraceRecord(prompt_id="long", prompt_len=200, response_len=8000)] * 8
    hist += [TraceRecord(prompt_id=f"s{k}", prompt_len=6000, response_len=1000) for k in range(16)] * 2
    return Trace(name="t", records=tuple(recs), max_new_tokens=M, history=tuple(hist))


def _run(long_len: int):
    hw, model = gpu_setup("h100", "llama31_8b", "central")
    cfg = PlannerConfig(candidate_tps=TPS, start_layout=False, estimator="drain")
    return run_mixed_pat(hw, _trace(long_len), Planner(model, cfg), num_devices=8, handoff=handoff_cost(model))


def test_the_planner_never_sees_true_lengths() -> None:
    """Two stages that differ only in how long the two long requests run: every decision is taken before they
    finish, so every one (and every layout up to the end) must be the same: the planner cannot tell the stages
    apart. It regroups part of the pool and, from a mixed layout, the whole pool (the path where the layout's TP
    is 0: the switch's measurement names the largest block as its source)."""
    a, b = _run(8000), _run(9500)
    assert a.latency_s < b.latency_s
    assert [(d.step, d.reason) for d in a.decisions] == [(d.step, d.reason) for d in b.decisions]
    assert a.layouts == b.layouts
    kinds = [getattr(d, "action", None) for d in a.decisions]
    assert "merge" in kinds and any(getattr(d, "source_tp", None) == 0 for d in a.decisions), kinds


def test_a_mixed_layout_has_no_uniform_state_and_a_whole_pool_switch_is_priced_from_its_largest_block() -> None:
    hw, _ = gpu_setup("h100", "llama31_8b", "central")
    sim = MixedSim(hw, _trace(3000), num_devices=8, policy=StaticPolicy(1))
    sim.run(stop=lambda s: s.step >= 50)
    sim.apply(Merge(start=0, size=1))
    view = sim.view()
    assert view.mixed_state.blocks == ((0, 2), *((i, 1) for i in range(2, 8))) and view.mixed_state.tp == 0
    assert {r.request_id for r in view.mixed_state.requests} == set(sim.where)
    with pytest.raises(ValueError, match="mixed_state"):
        view.state  # noqa: B018
    sim.apply(Reconfigure(tp=4))  # 2+1+1+1+1+1+1 -> 4+4: the source is the largest block
    sample = sim.view().samples[-1]
    assert isinstance(sample, ReconfigSample) and (sample.tp_src, sample.tp_dst) == (2, 4)
    sim.apply(Split(start=4, size=4))
    sim.apply(Merge(start=4, size=2))  # 4+2+2 -> 4+4 (no sample: a buddy action)
    sim.apply(Split(start=4, size=4))
    before = sim.overhead
    sim.apply(Reconfigure(tp=2))  # 4+2+2 -> 2+2+2+2: the TP4 block's devices load w / 2 - w / 4
    sample = sim.view().samples[-1]
    assert isinstance(sample, ReconfigSample) and (sample.tp_src, sample.tp_dst) == (4, 2)
    rc = hw.reconfig
    assert sim.overhead - before >= (hw.param_bytes / 4) / rc.reshard_bytes_per_s + rc.fixed_s + rc.switch_s
    sim.apply(Merge(start=0, size=2))
    sim.apply(Reconfigure(tp=4))  # 4+2+2 -> 4+4: to the largest block's TP, no (tp_src, tp_dst) pair
    assert sim.sizes() == (4, 4) and not any(isinstance(x, ReconfigSample) for x in sim.view().samples)


def test_mixed_policy_turns_decisions_into_sim_actions(h100: LatencyModel) -> None:
    policy = MixedPlannerPolicy(_planner(h100), 1)
    assert isinstance(policy.mixed, MixedPlanner) and policy.mixed.planner is policy.planner


def test_sim_policies_mixed_pat_column_is_bench_mixed_vs_uniform_pat_row(capsys) -> None:
    """bench.sim_policies --mixed-pat prints the same mixed PAT and PAT latencies as bench.mixed_vs_uniform --pat on
    that row (one planner configuration, one simulator), and the summary line of their ratio."""
    from pat_rollout.bench.mixed_vs_uniform import run_pat_row
    from pat_rollout.bench.sim_policies import main

    main(["--models", "llama31_8b", "--gpus", "h100", "--variants", "central", "--traces", "deepscaler-16k",
          "--no-oracle", "--no-lookahead", "--mixed-pat"])
    out = capsys.readouterr().out
    r = run_pat_row("llama31_8b", "h100", "central", "deepscaler-16k", num_devices=8, seed=0)
    row = next(line for line in out.splitlines() if line.startswith("llama31_8b h100 central deepscaler-16k"))
    assert f" {r['pat_s']:.1f} " in row and f" {r['mixed_pat_s']:>7.1f} {r['ratio']:>8.3f} " in row
    assert r["mixed_pat_layouts"] in row
    assert f"Mixed PAT / PAT: 1 rows, median {r['ratio']:.3f}" in out
