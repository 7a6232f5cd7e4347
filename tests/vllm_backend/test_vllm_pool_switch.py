"""VllmPool on real vLLM engines (tiny random Llama, CPU): 2 x TP1 serves the HF greedy outputs; a mid-decode
switch 2 x TP1 -> 1 x TP2 -> 2 x TP1 (recomputation) ends with the tokens of an unswitched run, token for token,
log-probs close, while unseeded temperature-1 requests in the same batches hold equal token ids on both ranks of
the TP2 replica; a hung engine core misses its deadline as an unresponsive WorkerError naming its device;
weights loaded with update_weights serve, and a switch whose engine fails to start rolls back to the base layout
(restarted engines, the update loaded again) and loses nothing. One pool for the module (each engine start
costs tens of seconds here), the tests in file order."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

pytest.importorskip("vllm")

from hf_reference import hf_greedy  # noqa: E402

from pat_rollout.config import PatRolloutConfig  # noqa: E402
from pat_rollout.driver.errors import ReconfigurationError, WorkerError  # noqa: E402
from pat_rollout.layout import Layout  # noqa: E402
from pat_rollout.types import Request, SamplingParams  # noqa: E402

pytestmark = [pytest.mark.slow]

LOGPROB_ATOL = 1e-4
MAX_NEW = 24


@pytest.fixture(scope="module")
def pool(vllm_model):
    from pat_rollout.driver.backends import get_backend

    config = PatRolloutConfig(model_path=vllm_model, num_devices=2, backend="vllm", initial_tp=1,
                              candidate_tps=(1, 2), policy="manual", kv_handoff="recompute",
                              comm_timeout_s=5.0, rpc_timeout_s=15.0)
    backend = get_backend("vllm")
    p = backend.build_pool(config, backend.model_spec(config), Layout.uniform(2, 1), cost=None,
                           num_cpus_per_worker=1)
    yield p
    p.shutdown()


def _requests(tag: str) -> list[Request]:
    sp = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    return [Request(request_id=f"{tag}{i}", prompt_token_ids=tuple(range(3 + 5 * i, 10 + 7 * i)), sampling=sp)
            for i in range(4)]


def _split(reqs: list[Request], n: int) -> dict[int, list[Request]]:
    return {r: reqs[r::n] for r in range(n)}


def _run(pool, steps: int | None = None) -> dict[str, object]:
    """Step every busy replica until all finish (or `steps` rounds); the finished outputs by id."""
    done: dict[str, object] = {}
    rounds = 0
    while any(rep.busy() for rep in pool.replicas) and (steps is None or rounds < steps):
        busy = [r for r, rep in enumerate(pool.replicas) if rep.busy()]
        for res, _snap in pool.step(busy, 1).values():
            done.update({o.request_id: o for o in res.finished})
        rounds += 1
    return done


@pytest.fixture(scope="module")
def unswitched(pool, vllm_model):
    reqs = _requests("u")
    pool.add_requests(_split(reqs, 2))
    outs = _run(pool)
    return {rid[1:]: o for rid, o in outs.items()}


def test_2xtp1_equals_hf(pool, unswitched, vllm_model):
    reqs = _requests("u")
    assert sorted(unswitched) == [r.request_id[1:] for r in reqs]
    for r, (ids, lps) in zip(reqs, hf_greedy(vllm_model, reqs)):
        o = unswitched[r.request_id[1:]]
        assert list(o.token_ids) == ids, r.request_id
        assert o.log_probs == pytest.approx(lps, abs=LOGPROB_ATOL)
        assert o.finish_reason == "length" and o.prompt_token_ids == r.prompt_token_ids


def _assert_kv_split_by_heads(tp1: dict, tp2: list[dict]) -> None:
    """The KV hand-off's layout fact (pat_rollout/vllm/README.md, "KV migration"): the KV blocks TP2 rank h holds
    for a request are the TP1 replica's blocks of KV head h, element for element, whatever the attention
    backend's packing inside a block; so a switch between TP1 and TP2 moves whole per-head sub-blocks. Both
    engines are fresh (unwritten KV is zero; the engine core may have run a few steps past what the pool read
    before the abort): compared where both wrote, at least the 15 tokens (7 prompt + 8 generated) s0 had at the
    switch, K and V (2 x head_dim 32 values per token and head)."""
    assert sorted(tp1) == sorted(tp2[0]) == sorted(tp2[1]) and len(tp1) == 2  # 2 layers
    for layer, full in tp1.items():
        assert full.shape[1] == 2 and all(r[layer].shape[1] == 1 for r in tp2)
        for h in range(2):
            part = tp2[h][layer][:, 0]
            ref = full[:part.shape[0], h]
            both = (part != 0) & (ref != 0)
            assert int(both.sum()) >= 15 * 64, (layer, h, int(both.sum()))
            assert torch.allclose(ref[both], part[both], atol=1e-4), (layer, h)


def test_switch_mid_decode_2xtp1_tp2_2xtp1_equals_unswitched(pool, unswitched):
    assert pool.layout == Layout.uniform(2, 1)
    reqs = _requests("s")
    hot = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, ignore_eos=True)  # unseeded
    sampled = [Request(request_id=f"t{i}", prompt_token_ids=(5 + i, 9, 11 + 2 * i), sampling=hot) for i in range(2)]
    pool.add_requests(_split(reqs + sampled, 2))
    done = _run(pool, steps=4)
    assert not done
    seen = {rid: len(t.token_ids) for rep in pool.replicas for rid, t in rep.tracked.items()}
    assert sorted(seen) == sorted(r.request_id for r in reqs + sampled), seen
    assert all(0 < n < MAX_NEW for n in seen.values()), seen

    res = pool.reconfigure(2, {r.request_id: i % 2 for i, r in enumerate(reqs)})
    assert pool.layout == Layout.uniform(2, 2) and res.dst == pool.layout
    assert sorted(res.recomputed) == sorted(seen) and set(res.assignment.values()) == {0}
    assert [(i["device"], i["replica"], i["tp_rank"]) for i in pool.info()] == [(0, 0, 0), (1, 0, 1)]
    done.update(_run(pool, steps=4))
    mid = {rid: len(t.token_ids) for rep in pool.replicas for rid, t in rep.tracked.items()}
    assert sorted(mid) == sorted(seen) and all(seen[rid] < n < MAX_NEW for rid, n in mid.items()), (seen, mid)
    rank0, rank1 = pool.replicas[0].rank_token_ids()  # the TP2 replica's two workers
    assert len(rank0) == len(mid) and rank0 == rank1  # every request, sampled ones included: same ids on both
    kv_tp2 = pool.replicas[0].kv_blocks("s0")  # per rank, per layer: [blocks, 1 KV head, ...] (a fresh engine)

    res = pool.reconfigure(1, {rid: 0 for rid in mid})
    assert pool.layout == Layout.uniform(2, 1) and sorted(res.recomputed) == sorted(mid)
    assert set(res.assignment.values()) == {0, 1}
    # The KV read needs s0 scheduled on its new worker: a step returns with the first output of any request, and
    # vLLM may admit s0 (recomputed: a long prefill) in a later step; on a quiet machine one step was too few.
    s0 = pool.replicas[res.assignment["s0"]]
    for _ in range(MAX_NEW):
        done.update(_run(pool, steps=1))
        assert "s0" not in done
        if len(s0.tracked["s0"].token_ids) > mid["s0"]:
            break
    assert len(s0.tracked["s0"].token_ids) > mid["s0"], "s0 was not scheduled on its new replica"
    _assert_kv_split_by_heads(s0.kv_blocks("s0")[0], kv_tp2)
    done.update(_run(pool))
    assert sorted(done) == sorted(r.request_id for r in reqs + sampled)
    for r in sampled:
        o = done.pop(r.request_id)
        assert len(o.token_ids) == MAX_NEW and all(0 <= t < 250 for t in o.token_ids) and o.finish_reason == "length"
        assert all(lp <= 0.0 for lp in o.log_probs) and len(o.log_probs) == MAX_NEW
    for rid, o in done.items():
        ref = unswitched[rid[1:]]
        assert o.token_ids == ref.token_ids, rid
        assert o.log_probs == pytest.approx(ref.log_probs, abs=LOGPROB_ATOL), rid
        assert o.finish_reason == "length"


def test_hung_engine_core_misses_its_deadline(pool):
    """SIGSTOP replica 1's engine core: the step waits at most rpc_deadline_s for an output, then names device 1."""
    sp = SamplingParams(max_new_tokens=480, ignore_eos=True)  # far more steps than the core runs before the stop
    pool.add_requests({1: [Request(request_id="h0", prompt_token_ids=(4, 8, 15, 16, 23, 42), sampling=sp)]})
    pid = pool.replicas[1].engine_core_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match="replica 1 on devices \\[1\\]: no engine-core output within") as e:
            pool.step([1], 10_000)
        waited = time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
    assert e.value.unresponsive and e.value.devices == (1,)
    assert waited >= pool.config.rpc_deadline_s(0)  # it waited the deadline (and then gave up)
    outs = pool.abort_all()
    assert [o.request_id for o in outs] == ["h0"] and outs[0].finish_reason == "abort"



# phase -> (request-id tag, what the error says, engines of the old layout restarted by the rollback, requests
# exported before the fault and resubmitted by the rollback)
FAULTS = {
    "export": ("e", "after exporting replica 0", 0, 2),  # replica 0 exported, replica 1 not: both engines kept
    "stop": ("p", "after stopping replica 0", 1, 4),  # replica 0's engine stopped (restarted), replica 1's kept
    "import": ("i", "after resubmitting request", 2, 4),  # on the new TP2 engine: it stops, both TP1 engines restart
}


@pytest.mark.parametrize("phase", list(FAULTS))
def test_fault_in_switch_phase_rolls_back_to_the_old_layout(pool, unswitched, phase):
    """A fault injected in one phase of 2 x TP1 -> 1 x TP2 (part-way through it: some replicas exported, stopped,
    or some requests resubmitted) rolls back to 2 x TP1: the error names the phase, every request is back on
    the replica it ran on (engines still running are kept), and greedy outputs end equal to the unswitched
    run's, token for token. (The start phase: test_update_weights_then_failed_switch_rolls_back.)"""
    tag, where, restarted, exported = FAULTS[phase]
    assert pool.layout == Layout.uniform(2, 1)
    reqs = [Request(request_id=tag + r.request_id[1:], prompt_token_ids=r.prompt_token_ids, sampling=r.sampling)
            for r in _requests("u")]
    split = _split(reqs, 2)
    pool.add_requests(split)
    assert not _run(pool, steps=3)
    pids = [rep.engine_core_pid() for rep in pool.replicas]
    pool.fail_next(phase)
    t0 = time.monotonic()
    with pytest.raises(ReconfigurationError, match=f"phase {phase} .*injected failure in VllmPool switch phase "
                                                   f"'{phase}' {where}.*rolled back to the old layout 2xTP1.* "
                                                   f"\\({restarted} engines restarted\\), {exported} of 4 unfinished") as e:
        pool.reconfigure(2, {r.request_id: i % 2 for i, r in enumerate(reqs)})
    print(f"{phase}: rolled back in {time.monotonic() - t0:.1f} s")
    assert pool.layout == Layout.uniform(2, 1) and len(pool.replicas) == 2
    assert e.value.assignment == {r.request_id: i for i, rs in split.items() for r in rs}
    kept = [old == rep.engine_core_pid() for old, rep in zip(pids, pool.replicas)]
    assert kept.count(False) == restarted, (pids, kept)
    done = _run(pool)
    assert sorted(done) == sorted(r.request_id for r in reqs)
    for rid, o in done.items():
        ref = unswitched[rid[1:]]
        assert o.token_ids == ref.token_ids, (phase, rid)
        assert o.log_probs == pytest.approx(ref.log_probs, abs=LOGPROB_ATOL), (phase, rid)


def test_update_weights_then_failed_switch_rolls_back(pool, tmp_path_factory):
    """Load another checkpoint's tensors (HF names, two buckets) into 2 x TP1: every rank holds them once the
    pool serves. Then a switch whose engine fails to start rolls back to 2 x TP1 (fresh engines, started from the
    updated checkpoint) and loses nothing: every request ends with the new weights' HF greedy output."""
    from safetensors.torch import load_file

    from pat_rollout.models import make_tiny_model

    assert pool.layout == Layout.uniform(2, 1) and pool.weights_in_any_layout
    other = make_tiny_model(tmp_path_factory.mktemp("models") / "llama32_seed1", "llama", seed=1, hidden_size=128,
                            head_dim=32)
    named = sorted(load_file(str(other / "model.safetensors")).items())
    cut = [n for n, _ in named].index("model.layers.0.self_attn.q_proj.weight") + 1
    pool.update_weights(named[:cut])  # q and k of layer 0 in one bucket, its v in the next (sorted names)
    pool.update_weights(named[cut:])
    new = dict(named)

    def holds_update() -> bool:  # linear weights are repacked on CPU (their parameters are empty): norm, embedding
        names = ["model.layers.1.input_layernorm.weight", "model.embed_tokens.weight"]
        ranks = [rep.params(names)[0] for rep in pool.replicas]
        return all(p[names[0]].equal(new[names[0]]) and p[names[1]][:250].equal(new[names[1]]) for p in ranks)

    assert not holds_update()  # not yet: the update reaches the engines when the pool next serves
    reqs = _requests("b")
    pool.add_requests(_split(reqs, 2))
    assert holds_update()
    done = _run(pool, steps=3)
    assert not done
    pool.fail_next("start")  # the new layout's (only) engine fails to start
    with pytest.raises(ReconfigurationError, match="phase start .*injected failure in VllmPool switch phase "
                                                   "'start' starting replica 0 .*rolled back to the old layout "
                                                   "2xTP1.* \\(2 engines restarted\\)") as e:
        pool.reconfigure(2, {r.request_id: i % 2 for i, r in enumerate(reqs)})
    assert pool.layout == pool.base == Layout.uniform(2, 1) and len(pool.replicas) == 2
    assert sorted(e.value.assignment) == sorted(r.request_id for r in reqs)
    assert set(e.value.assignment.values()) == {0, 1}
    assert holds_update()  # the restarted engines hold the update, not the checkpoint
    done = _run(pool)
    assert sorted(done) == sorted(r.request_id for r in reqs)
    for r, (ids, lps) in zip(reqs, hf_greedy(str(other), reqs)):
        assert list(done[r.request_id].token_ids) == ids, r.request_id
        assert done[r.request_id].log_probs == pytest.approx(lps, abs=LOGPROB_ATOL)


def test_killed_engine_core_fails_the_step_naming_its_device(pool):
    """Last (it breaks the pool): SIGKILL replica 0's engine core mid-decode; the next step fails at once with an
    unresponsive WorkerError naming device 0, long before the deadline, and the pool still shuts down."""
    sp = SamplingParams(max_new_tokens=480, ignore_eos=True)
    pool.add_requests({0: [Request(request_id="k0", prompt_token_ids=(4, 8, 15, 16, 23, 42), sampling=sp)]})
    pid = pool.replicas[0].engine_core_pid()
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="decode step on replica 0 \\(devices \\[0\\]\\)") as e:
        pool.step([0], 10_000)
    assert e.value.unresponsive and e.value.devices == (0,)
    assert time.monotonic() - t0 < pool.config.rpc_deadline_s(0)
