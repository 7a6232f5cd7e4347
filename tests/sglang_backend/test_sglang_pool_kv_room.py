"""KV room follows the layout on the SGLang pool (real SGLang, CPU, tiny Qwen3 with 2 KV heads).

SGLang allocates its KV storage once, for the base layout (2 x TP1: every rank holds both KV heads). A switch to
1 x TP2 views the same storage (same addresses) for one head per rank, so the TP2 replica holds twice the tokens
of a TP1 replica (`planner.capacity.tokens_in_room`), and SGLang's scheduler admits against the new limits. With
a KV budget that fits two of four requests, one TP1 replica runs two and queues two; after the switch the TP2
replica runs all four at once, and the outputs equal HF greedy. Back in 2 x TP1 every limit is what it was.
Overlap scheduling is on (the pool's default). Run with both input paths: per-replica input (the default) and the
lockstep fallback (SGLang's broadcast over the whole pool).
"""

from __future__ import annotations

import asyncio
import functools

import pytest
from sgl_pool_waits import wait_info

pytest.importorskip("sglang.srt")

from pat_rollout.config import PatRolloutConfig  # noqa: E402
from pat_rollout.sglang.pool_hooks import REPLICA_INPUT_ENV  # noqa: E402
from pat_rollout.types import Request, SamplingParams  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

# 480 tokens per request (the tiny models' context is 512): long enough that the first two are still decoding
# after the checks below (with 128-token requests, 0.5.12 on an idle machine showed (2, 0) after the 0.3 s wait).
PROMPT, MAX_NEW = 16, 464
KV_TOKENS = 1100  # per TP1 replica: two requests fit (960), three do not (1440); TP2 holds ~2200: four fit (1920)


_wait_info = functools.partial(wait_info, timeout=120.0)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("per_replica_input", ["1", "0"], ids=["per-replica-input", "lockstep"])
def test_tp2_replica_admits_what_a_tp1_replica_queued(tiny_models, hf_reference, monkeypatch, per_replica_input):
    from pat_rollout.layout import Layout
    from pat_rollout.planner.capacity import tokens_in_room
    from pat_rollout.sglang.pool import SglPool, check_model

    monkeypatch.setenv(REPLICA_INPUT_ENV, per_replica_input)  # inherited by the scheduler processes
    path = tiny_models["qwen3"]
    cfg = PatRolloutConfig(model_path=path, num_devices=2, backend="sglang", initial_tp=1, candidate_tps=(1, 2),
                           policy="manual", kv_handoff="recompute", dtype="float32",
                           engine_args={"max_total_tokens": KV_TOKENS})
    spec = check_model(cfg)
    pool = SglPool(cfg, spec, Layout.uniform(2, 1), device="cpu")
    try:
        assert pool.client.sgl.server_args.disable_overlap_schedule is False
        base = pool.info()
        assert [i["per_replica_input"] for i in base] == [per_replica_input == "1"] * 2  # the path under test
        assert [i["kv_tokens"] for i in base] == [KV_TOKENS] * 2 and pool.kv_tokens == KV_TOKENS
        storage = [i["kv_storage"] for i in base]
        sp = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
        reqs = [Request(request_id=f"k{i}", prompt_token_ids=tuple(range(3 + 7 * i, 3 + 7 * i + PROMPT)),
                        sampling=sp) for i in range(4)]
        pool.add_requests({0: reqs})  # all four on the first TP1 replica (rank 0)
        info = _wait_info(pool, lambda x: x[0]["num_running"] == 2 and x[0]["num_waiting"] == 2,
                          "2 running + 2 waiting on rank 0")
        assert info[1]["num_running"] == info[1]["num_waiting"] == 0
        pool.client.loop.run_until_complete(asyncio.sleep(0.3))  # some decode steps later still only two fit
        full = pool.info()
        assert [(i["num_running"], i["num_waiting"]) for i in full] == [(2, 2), (0, 0)]
        # rank 0 failed to admit: its running batch is marked full, its new-token ratio decayed; rank 1 is idle
        assert full[0]["admission"]["batch_is_full"] and not full[1]["admission"]["batch_is_full"]
        assert full[0]["admission"]["new_token_ratio"] < full[1]["admission"]["new_token_ratio"]

        pool.reconfigure(2, dict(pool._replica))
        grown = pool.info()
        # the same storage, viewed for one KV head per rank: twice the slots (SGLang keeps one padding slot)
        assert [i["kv_storage"] for i in grown] == storage
        assert [i["kv_heads"] for i in grown] == [1, 1]
        # the two ranks of the new replica admit alike (a stale `batch_is_full` on rank 0 hung CI: rank 1 ran a
        # prefill rank 0 did not)
        assert grown[0]["admission"] == grown[1]["admission"]
        per_token = spec.kv_bytes_per_token(1, 4)  # every KV head, float32
        expect = tokens_in_room((KV_TOKENS + 1) * per_token, kv_bytes_per_token=per_token,  # + 1 padding slot
                                num_kv_heads=spec.num_kv_heads, tp=2) - 1
        assert expect == 2 * KV_TOKENS + 1 and pool.kv_tokens == expect
        for i in grown:
            lim = i["kv_limits"]
            assert i["kv_tokens"] == lim["pool_size"] == lim["allocator_size"] == lim["max_total_num_tokens"] == expect
        # the TP2 replica admits all four at once
        info = _wait_info(pool, lambda x: all(i["num_running"] == 4 and i["num_waiting"] == 0 for i in x),
                          "4 running on both ranks of the TP2 replica")
        outs = {o.request_id: o for o in pool.client.run_to_completion(timeout=600)}
        for r in reqs:
            ref_ids, _ = hf_reference(path, list(r.prompt_token_ids), MAX_NEW)
            assert outs[r.request_id].finish_reason == "length"
            assert list(outs[r.request_id].token_ids) == ref_ids, r.request_id

        pool.reconfigure(1, {})
        back = pool.info()
        assert [i["kv_storage"] for i in back] == storage and pool.kv_tokens == KV_TOKENS
        assert [i["kv_limits"] for i in back] == [i["kv_limits"] for i in base]
    finally:
        pool.shutdown()
