"""reclaim_weight_memory on the SGLang pool (real SGLang, CPU, tiny Qwen3 with 2 KV heads; vmem.host.HostMapper:
the CPU analogue of the CUDA driver's virtual memory, docs/kv_reclaim.md).

Inside SGLang's start-up, in each scheduler process, every parameter storage is adopted into ranges the rank's
HostMapper reserved right after `load_model` (before the KV pool is allocated) and every KV storage right after the
KV pool's allocation, both before the start-up graph-capture seam (`kv_room.install_startup_hooks`; the recorded event
sequence says so: each parameter's address lies in a weight range, each KV storage starts its KV range, from the
capture seam on).

A grow from 2 x TP1 to 1 x TP2 lends the half of every sharded weight storage the TP2 shard no longer uses (4 KiB
granules here) to the KV storages: SGLang's limits become the planned room (base room + lent bytes, the capacity
rule), more than the plain pool's 2 x TP1, so six requests of 470 tokens that the plain pool's TP2 (2201 tokens)
could not hold run at once. The shrink back gives those pages back: each TP1 replica receives three requests
whose migrated KV (3 x >= 380 tokens) exceeds its 1100 tokens, so the one that no longer fits is not inserted and
its resubmission recomputes it (it waits until a request finishes). Outputs equal HF greedy; the limits are the
base layout's again. The pages really move: after the grow the mapper holds every lent page at its KV slot (the
weights' addresses of those pages are unmapped: touching them would fault), after the shrink they are home and
the weights are bit-exact the unswitched model's (the shrink's reshard rewrote the bytes KV had used).
"""

from __future__ import annotations

import functools

import pytest
from sgl_pool_waits import wait_info

pytest.importorskip("sglang.srt")

from pat_rollout.config import PatRolloutConfig  # noqa: E402
from pat_rollout.types import Request, SamplingParams  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

PROMPT, MAX_NEW = 380, 90  # 470 tokens (the tiny models have 512); >= 380 of KV each from the prefill on
KV_TOKENS = 1100  # per TP1 replica: two requests (940) fit, three (1410) do not


def _params(pool, path) -> list[dict]:
    return [p["params"] for p in pool.save_params(str(path))]


_wait_info = functools.partial(wait_info, timeout=180.0)


@pytest.mark.timeout(900)
def test_reclaiming_grow_admits_the_planned_room_and_the_shrink_recomputes_what_no_longer_fits(
        tiny_models, hf_reference, monkeypatch, tmp_path):
    import torch

    from pat_rollout.layout import Layout
    from pat_rollout.planner.capacity import tokens_in_room
    from pat_rollout.sglang.kv_room import RECLAIM_GRANULE_ENV
    from pat_rollout.sglang.pool import SglPool, check_model

    monkeypatch.setenv(RECLAIM_GRANULE_ENV, "4096")  # inherited by the scheduler processes
    path = tiny_models["qwen3"]
    cfg = PatRolloutConfig(model_path=path, num_devices=2, backend="sglang", initial_tp=1, candidate_tps=(1, 2),
                           policy="manual", kv_handoff="migrate", dtype="float32", reclaim_weight_memory=True,
                           engine_args={"max_total_tokens": KV_TOKENS})
    spec = check_model(cfg)
    pool = SglPool(cfg, spec, Layout.uniform(2, 1), device="cpu")
    try:
        base = pool.info()
        assert pool.kv_tokens == KV_TOKENS
        start = [r["reclaim"] for r in pool.reclaim_start]
        for r, i in zip(start, base):
            assert r["mapper"] == "HostMapper" and r["tp"] == 1 and r["lent_pages"] == 0
            assert i["reclaim"]["weight_ranges"] == r["weight_ranges"]
            inside = [n for n, ptr in i["param_ptrs"].items()
                      if any(a <= ptr < a + n_ for a, n_ in r["weight_ranges"])]
            assert sorted(inside) == sorted(i["param_ptrs"]), "a parameter outside the reserved weight ranges"
            assert i["kv_storage"] == sorted(k[0] for k in r["kv_ranges"])  # each KV storage starts its range
            assert r["mapper_kv_mapped"] == [k[2] for k in r["kv_ranges"]]  # the base extent only
            assert r["mapper_weight_mapped"] == sum(n for _, n in r["weight_ranges"]) == r["physical_bytes"] - sum(
                k[2] for k in r["kv_ranges"])
        for r in start:  # the order inside SGLang's start-up, as each scheduler process recorded it
            events = [e["event"] for e in r["events"]]
            assert events[:6] == ["model_loaded", "weights_adopted", "kv_alloc_begin", "kv_allocated", "kv_adopted",
                                  "capture"], events
            ev = dict(zip(events[:6], r["events"][:6]))
            kv_starts = sorted(k[0] for k in r["kv_ranges"])
            assert ev["model_loaded"]["params_in_ranges"] is None  # nothing reserved yet
            assert ev["weights_adopted"]["params_in_ranges"] is True
            assert ev["kv_alloc_begin"]["params_in_ranges"] is True  # weights adopted before the KV pool exists
            assert ev["kv_alloc_begin"]["kv_storage"] is None
            assert ev["kv_allocated"]["kv_at_ranges"] is False  # SGLang's own allocation, outside the ranges
            assert not set(ev["kv_allocated"]["kv_storage"]) & set(kv_starts)
            for name in ("kv_adopted", "capture"):  # what a CUDA-graph capture would record
                assert ev[name]["params_in_ranges"] is True and ev[name]["kv_at_ranges"] is True, name
                assert ev[name]["kv_storage"] == kv_starts, name
        unswitched = _params(pool, tmp_path / "unswitched")
        sp = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
        reqs = [Request(request_id=f"r{i}", sampling=sp,
                        prompt_token_ids=tuple((5 + 11 * i + 3 * j) % 240 + 5 for j in range(PROMPT)))
                for i in range(6)]
        pool.add_requests({0: reqs})  # all six on the first TP1 replica (rank 0)
        _wait_info(pool, lambda x: x[0]["num_running"] == 2 and x[0]["num_waiting"] == 4,
                   "2 running + 4 waiting on rank 0")

        pool.reconfigure(2, dict(pool._replica))
        rec = [r["reclaim"] for r in pool.last_switch]
        per_token = spec.kv_bytes_per_token(1, 4)  # every KV head, float32: 512 B
        base_room = (KV_TOKENS + 1) * per_token  # SGLang's storage: the slots + one padding slot
        for r in rec:
            assert r["tp"] == 2 and r["granule"] == 4096 and r["reclaimed_bytes"] > 0
            assert r["room_bytes"] == base_room + r["reclaimed_bytes"] == r["planned_room"]["2"]
            assert r["planned_room"]["1"] == base_room
            assert 0 <= r["freed_bytes"] - r["reclaimed_bytes"] < 4096 * 2 * 16  # rounding: < 2 granules a storage
            assert r["physical_bytes"] == r["peak_physical"]  # pages moved, nothing allocated
            assert r["lent_at_kv_slots"] and r["mapper"] == "HostMapper"  # the mapper's state, not only the plan's
            assert r["mapper_kv_mapped"] == r["kv_mapped_bytes"]
            assert all(m > k[2] for m, k in zip(r["mapper_kv_mapped"], r["kv_ranges"]))
            assert r["mapper_weight_mapped"] == sum(n for _, n in r["weight_ranges"]) - r["reclaimed_bytes"]
        expect = tokens_in_room(rec[0]["room_bytes"], kv_bytes_per_token=per_token, num_kv_heads=2, tp=2) - 1
        assert pool.kv_tokens == expect > 2 * KV_TOKENS + 1  # the plain pool's TP2 room
        assert expect >= 6 * (PROMPT + MAX_NEW)
        for i in pool.info():
            lim = i["kv_limits"]
            assert i["kv_tokens"] == lim["pool_size"] == lim["allocator_size"] == lim["max_total_num_tokens"] == expect
        _wait_info(pool, lambda x: all(i["num_running"] == 6 and i["num_waiting"] == 0 for i in x),
                   "6 running on both ranks of the TP2 replica")

        res = pool.reconfigure(1, {r.request_id: pool._replica[r.request_id] for r in reqs})
        no_room = {rid for r in pool.last_switch for rid in r["no_room"]}
        assert len(no_room) == 2 and no_room <= set(res.recomputed) and not no_room & set(res.migrated)
        assert len(res.migrated) == 4
        assert pool.kv_tokens == KV_TOKENS
        assert [r["reclaim"]["lent_pages"] for r in pool.last_switch] == [0, 0]
        for r in (x["reclaim"] for x in pool.last_switch):
            assert r["mapper_kv_mapped"] == [k[2] for k in r["kv_ranges"]]
            assert r["mapper_weight_mapped"] == sum(n for _, n in r["weight_ranges"])
        back = _params(pool, tmp_path / "back")
        for rank in range(2):  # bit-exact: the pages came home and the reshard rewrote what KV had written
            assert back[rank].keys() == unswitched[rank].keys()
            for n, t in unswitched[rank].items():
                assert back[rank][n].dtype == t.dtype and torch.equal(back[rank][n], t), (rank, n)
        def fixed(info):  # the limits (what is free now differs: requests are running)
            return [{k: v for k, v in i["kv_limits"].items() if k != "available"} for i in info]

        assert fixed(pool.info()) == fixed(base)
        outs = {o.request_id: o for o in pool.client.run_to_completion(timeout=600)}
        for r in reqs:
            ref_ids, _ = hf_reference(path, list(r.prompt_token_ids), MAX_NEW)
            assert outs[r.request_id].finish_reason == "length"
            assert list(outs[r.request_id].token_ids) == ref_ids, r.request_id
    finally:
        pool.shutdown()


@pytest.mark.parametrize("engine_args, error", [
    ({"enable_memory_saver": True},
     r"reclaim_weight_memory=True with engine_args\['enable_memory_saver'\]=True is not supported: .* memory saver "
     r"does not manage"),
    ({"startup_weight_load_mode": "overlap"},
     r"reclaim_weight_memory=True with startup_weight_load_mode='overlap' is not supported"),
], ids=["memory-saver", "overlapped-load"])
def test_reclaiming_refuses_what_the_adoption_cannot_serve_before_anything_starts(tiny_models, engine_args, error):
    """SGLang's memory saver would not release the adopted storages, and an overlapped weight load commits the real
    weights after the adoption: refused before the engine launches (the memory saver on the CPU too, where the pool
    otherwise drops enable_memory_saver)."""
    from pat_rollout.layout import Layout
    from pat_rollout.sglang.pool import SglPool, check_model

    cfg = PatRolloutConfig(model_path=tiny_models["qwen3"], num_devices=2, backend="sglang", initial_tp=1,
                           candidate_tps=(1, 2), policy="manual", dtype="float32", reclaim_weight_memory=True,
                           engine_args=engine_args)
    with pytest.raises(ValueError, match=error):
        SglPool(cfg, check_model(cfg), Layout.uniform(2, 1), device="cpu")
