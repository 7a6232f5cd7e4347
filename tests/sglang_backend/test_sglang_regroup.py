"""PAT reconfiguration on SGLang's own state (tiny Qwen3 and Llama, CPU): TP=1 replicas -> TP=2.

Separate engines (fixture `regrouped`): each TP=1 engine reshards its live SGLang parameters in place inside
its scheduler process with pat_rollout's plan (grow by merge: every device keeps a slice of what it holds,
nothing moves); the shards are loaded with SGLang's `update_weights_from_tensor(load_format="direct")` into
a TP=2 engine started with random (`load_format="dummy"`) weights, which must then decode exactly like HF
and like the TP=1 engine before the switch.

Same processes (`test_in_process_*`, `test_serve_tp1_*`): one engine's two ranks hold TP=1 replicas, and
`regroup_grow` switches them in place to SGLang's TP=2 group (weights, module tree, KV heads), mid-decode.
"""

from __future__ import annotations

import pytest

# "sglang.srt": a bare "sglang" could resolve to a namespace package of a same-named folder on sys.path.
pytest.importorskip("sglang.srt")

import torch  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

PROMPTS = [list(range(3 + 5 * i, 10 + 7 * i)) for i in range(3)]
MAX_NEW = 12


def _greedy(eng, prompts):
    outs = eng.generate(input_ids=prompts, sampling_params=dict(max_new_tokens=MAX_NEW, temperature=0.0,
                                                                 ignore_eos=True))
    return [list(o["output_ids"]) for o in outs]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_in_process_grow_same_processes(arch, tiny_models, tmp_path, hf_reference):
    """One engine's two scheduler processes hold TP=1 replicas (full weights, TP=1 module shapes, built
    under SGLang's `patch_tensor_parallel_group` with a cached singleton group); `regroup_grow` reshards
    the live Parameters in place, rebuilds the module tree for TP=2 around the same Parameter objects and
    swaps it in, in the same processes. Generation must then equal HF."""
    from pat_rollout.reshard.apply import shard
    from pat_rollout.sglang.regroup import launch_pat_engine, regroup_grow, save_params
    from pat_rollout.sglang.scheduler_hooks import sglang_specs

    path = tiny_models[arch]
    eng = launch_pat_engine(path, tp_size=2, build_tp1=True, watchdog_timeout=120)
    try:
        before = save_params(eng, str(tmp_path / "before"), 2)
        info = before[0]["info"]
        specs = sglang_specs(info["hf_config"], info["padded_vocab"])
        for r in (0, 1):  # every rank is a full TP=1 replica
            for n, t in before[r]["params"].items():
                assert tuple(t.shape) == specs[n].shape, (r, n)
                torch.testing.assert_close(t, before[0]["params"][n], rtol=0, atol=0, msg=n)
        res = regroup_grow(eng, 2, str(tmp_path))
        after = save_params(eng, str(tmp_path / "after"), 2)
        tokens = [list(o["output_ids"]) for o in eng.generate(
            input_ids=PROMPTS, sampling_params=dict(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))]
    finally:
        eng.shutdown()
    for r in (0, 1):
        assert res[r]["new_rank"] == r and res[r]["num_moved"] == 0
        assert res[r]["same_object"] and all(res[r]["same_object"].values()), res[r]["same_object"]
        assert after[r]["info"]["tp_rank"] == r and after[r]["info"]["tp_size"] == 2
        assert set(after[r]["params"]) == set(before[r]["params"])
        for n, t in after[r]["params"].items():
            torch.testing.assert_close(t, shard(before[r]["params"][n], specs[n], r, 2), rtol=0, atol=0, msg=n)
    assert any(tuple(t.shape) != specs[n].shape for n, t in after[0]["params"].items())  # really narrowed
    for prompt, got in zip(PROMPTS, tokens):
        assert got == hf_reference(path, prompt, MAX_NEW)[0]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_serve_tp1_switch_mid_decode_keep_kv(arch, tiny_models, tmp_path, hf_reference):
    """Same processes throughout: the engine's two ranks serve as TP=1 replicas (model, KV pool and
    attention backend built under the cached singleton group, forwards run under it; both ranks get the
    same batches), requests are paused mid-decode (`pause_generation(in_place)`), `regroup_grow` reshards
    weights in place, rebuilds the modules, slices each rank's KV heads out of its TP=1 KV pool (kept
    tokens stay cached, no recompute), drops the singleton patch (SGLang's own TP=2 group takes over);
    decoding continues at TP=2 and must equal HF token for token."""
    import asyncio

    from sglang.srt.managers.io_struct import ContinueGenerationReqInput, PauseGenerationReqInput

    from pat_rollout.sglang.regroup import launch_pat_engine, regroup_grow

    path = tiny_models[arch]
    n = 40
    sp = dict(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    got: dict[int, tuple[list[int], dict | None]] = {}
    eng = launch_pat_engine(path, tp_size=2, build_tp1="serve", watchdog_timeout=120)
    try:
        async def consume(i):
            gen = await eng.async_generate(input_ids=PROMPTS[i], sampling_params=sp, stream=True)
            async for ch in gen:
                got[i] = (list(ch["output_ids"]), ch["meta_info"].get("finish_reason"))

        async def until(k):
            while min(len(got.get(i, ([], None))[0]) for i in range(len(PROMPTS))) < k:
                await asyncio.sleep(0.002)

        tasks = [eng.loop.create_task(consume(i)) for i in range(len(PROMPTS))]
        eng.loop.run_until_complete(until(3))
        tm = eng.tokenizer_manager
        eng.loop.run_until_complete(tm.pause_generation(PauseGenerationReqInput(mode="in_place")))
        res = regroup_grow(eng, 2, str(tmp_path))
        eng.loop.run_until_complete(tm.continue_generation(ContinueGenerationReqInput()))
        eng.loop.run_until_complete(asyncio.gather(*tasks))
    finally:
        eng.shutdown()
    for r in (0, 1):
        assert res[r]["num_moved"] == 0 and res[r]["kv_heads"] == 1  # 2 KV heads: one per TP=2 rank
        lens = res[r]["running_output_lens"]
        assert len(lens) == len(PROMPTS) and all(0 < k < n for k in lens), lens  # switched mid-decode
    for i, prompt in enumerate(PROMPTS):
        ids, finish = got[i]
        assert finish["type"] == "length"
        assert ids == hf_reference(path, prompt, n)[0], i


# Separate engines last: pytest keeps the last parametrized module fixture's 3 engines alive until the
# module ends, and the same-process tests above then run without them.
@pytest.fixture(scope="module", params=["qwen3", "llama"])  # qwen3: tied embedding; llama: separate lm_head
def regrouped(request, tiny_models, tmp_path_factory):
    from pat_rollout.sglang.regroup import launch_pat_engine, load_shards_direct, reshard_replicas_in_place, save_params

    path = tiny_models[request.param]
    work = str(tmp_path_factory.mktemp("regroup"))
    made = []
    try:
        a = launch_pat_engine(path, tp_size=1, watchdog_timeout=120)
        made.append(a)
        b = launch_pat_engine(path, tp_size=1, watchdog_timeout=120)
        made.append(b)
        t = launch_pat_engine(path, tp_size=2, watchdog_timeout=120, load_format="dummy")
        made.append(t)
        res = dict(path=path, arch=request.param)
        res["tp1_tokens"] = _greedy(a, PROMPTS)
        res["dummy_tokens"] = _greedy(t, PROMPTS)
        res["before"] = [save_params(e, f"{work}/before{d}", 1)[0] for d, e in enumerate((a, b))]
        res["resharded"] = reshard_replicas_in_place([a, b], 2, work)
        by_rank = [None, None]
        for r in res["resharded"]:
            by_rank[r["new_rank"]] = r["params"]
        load_shards_direct(t, by_rank)
        res["target"] = save_params(t, f"{work}/target", 2)
        res["tp2_tokens"] = _greedy(t, PROMPTS)
        yield res
    finally:
        for e in made:
            e.shutdown()


def test_in_place_shards_equal_plan_slices(regrouped):
    from pat_rollout.reshard.apply import shard
    from pat_rollout.sglang.scheduler_hooks import sglang_specs

    before = regrouped["before"]
    specs = sglang_specs(before[0]["info"]["hf_config"], before[0]["info"]["padded_vocab"])
    sharded = [n for n, s in specs.items() if s.dim is not None and n in before[0]["params"]]
    # fused qkv/gate_up, o/down, and the (tied) vocab-padded embedding are all covered
    assert any("qkv_proj" in n for n in sharded) and any("gate_up_proj" in n for n in sharded)
    assert any("o_proj" in n for n in sharded) and any("down_proj" in n for n in sharded)
    assert "model.embed_tokens.weight" in sharded
    assert ("lm_head.weight" in sharded) == (regrouped["arch"] == "llama")
    assert before[0]["info"]["padded_vocab"] == 256  # vocab 250 padded by SGLang to 64
    for d, res in enumerate(regrouped["resharded"]):
        assert res["new_rank"] == d and res["dst_groups"] == [[0, 1]]
        assert res["num_moved"] == 0 and res["num_transfers"] > 0
        assert set(res["params"]) == set(before[d]["params"])  # every SGLang param: sharded + replicated
        replicated = [n for n in res["params"] if n not in sharded]
        assert any("norm" in n for n in replicated)
        for n in replicated:
            torch.testing.assert_close(res["params"][n], before[d]["params"][n], rtol=0, atol=0, msg=n)
        for n in sharded:
            full = before[d]["params"][n]
            assert tuple(full.shape) == specs[n].shape, n
            assert res["same_object"][n], f"{n}: reshard_local replaced the SGLang Parameter instead of narrowing it"
            torch.testing.assert_close(res["params"][n], shard(full, specs[n], d, 2), rtol=0, atol=0, msg=n)


def test_target_tp2_params_are_the_resharded_shards(regrouped):
    for r, rank_dump in enumerate(regrouped["target"]):
        assert rank_dump["info"]["tp_rank"] == r and rank_dump["info"]["tp_size"] == 2
        src = next(x for x in regrouped["resharded"] if x["new_rank"] == r)["params"]
        for n, want in src.items():
            torch.testing.assert_close(rank_dump["params"][n], want, rtol=0, atol=0, msg=n)


def test_regrouped_tp2_greedy_equals_tp1_and_hf(regrouped, hf_reference):
    assert regrouped["dummy_tokens"] != regrouped["tp1_tokens"], "dummy weights already decode like the model"
    assert regrouped["tp2_tokens"] == regrouped["tp1_tokens"]
    for prompt, got in zip(PROMPTS, regrouped["tp2_tokens"]):
        ref, _ = hf_reference(regrouped["path"], prompt, MAX_NEW)
        assert got == ref
