"""Generate through verl's own rollout path on CPU: LLMServerManager builds PatReplicas (init_hybrid over a CPU
worker group), verl's load balancer + LLMServerClient route requests, verl's AgentLoopWorker (single-turn agent
loop + _postprocess) turns them into a DataProto; weights are synced through our ServerAdapter.

Parametrised over the driver inside the PatServer: "fake" (tests/verl/fake_driver.py, HF model, always runs),
"real" (pat_rollout.driver.RolloutDriver on the reference engine) and "sglang" (the same driver with
`engine_kwargs.pat.backend=sglang`: an SglPool of real SGLang engines; runs where verl and SGLang are both
installed, i.e. `make test-verl-sglang`, and skips elsewhere).
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

pytest.importorskip("verl")
pytest.importorskip("fastapi")
from verl_helpers import compose_ppo, pat_server_manager  # noqa: E402

pytestmark = [pytest.mark.verl, pytest.mark.ray, pytest.mark.slow]

PROMPT_LEN, RESPONSE_LEN = 64, 8
TP = 2  # each replica is one PAT pool of 2 devices
# fake: 4 dummy trainer workers -> 2 replicas (load balancing across pools); real: 2 -> 1 replica, so the
# real driver's 2 shard actors per pool fit the shared 8-CPU test cluster.
NUM_WORKERS = {"fake": 4, "real": 2, "sglang": 2}


def _driver_factory(kind: str):
    if kind == "fake":
        import fake_driver
        import ray

        ray.cloudpickle.register_pickle_by_value(fake_driver)
        return fake_driver.FakeRolloutDriver
    if kind == "sglang":
        import importlib.util

        if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("sglang.srt") is None:
            pytest.skip("SGLang is not installed in this environment (make install-verl-sglang)")
    from pat_rollout.driver import RolloutDriver

    return RolloutDriver


@pytest.fixture(scope="module", params=["fake", "real", "sglang"])
def pat_stack(request, ray_cluster, tiny_llama_with_tokenizer):
    factory = _driver_factory(request.param)
    backend = ["+actor_rollout_ref.rollout.engine_kwargs.pat.backend=sglang"] if request.param == "sglang" else []
    cfg = compose_ppo([*backend,
        "actor_rollout_ref.rollout.name=pat",
        f"actor_rollout_ref.model.path={tiny_llama_with_tokenizer}",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={TP}",
        f"data.max_prompt_length={PROMPT_LEN}",
        f"data.max_response_length={RESPONSE_LEN}",
        "trainer.n_gpus_per_node=4",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "+actor_rollout_ref.rollout.engine_kwargs.pat.initial_tp=1",
        "+actor_rollout_ref.rollout.engine_kwargs.pat.candidate_tps=[1,2]",
        "+actor_rollout_ref.rollout.engine_kwargs.pat.dtype=float32",
        "+actor_rollout_ref.rollout.engine_kwargs.pat.num_kv_blocks=64",
        # The planner's decisions only affect speed, not tokens; a builtin profile keeps this test independent
        # of whether a CPU profile has been measured on this machine.
        "+actor_rollout_ref.rollout.engine_kwargs.pat.profile_path=h100_llama31_8b",
    ])

    with pat_server_manager(cfg, factory, NUM_WORKERS[request.param], f"pat_test_{request.param}") as manager:
        yield request.param, cfg, manager


def _chat_prompt_ids(model_path: str, text: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)["input_ids"])


def _hf_greedy(model_path: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=2, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def test_replicas_and_servers(pat_stack):
    kind, cfg, manager = pat_stack
    replicas = manager.get_replicas()
    assert len(replicas) == NUM_WORKERS[kind] // TP
    assert {type(r).__name__ for r in replicas} == {"PatReplica"}
    assert len(set(manager.get_addresses())) == len(replicas)
    assert all(r.pat_config.num_devices == TP and r.pat_config.tp_sizes == (1, 2) for r in replicas)


def test_client_generate_token_output(pat_stack, tiny_llama_with_tokenizer):
    kind, cfg, manager = pat_stack
    client = manager.get_client()
    prompt = _chat_prompt_ids(tiny_llama_with_tokenizer, "What is 1 + 2?")

    async def run():
        sampled = [client.generate(uuid.uuid4().hex, prompt_ids=prompt, sampling_params=dict(
            temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True)) for _ in range(4)]
        greedy = [client.generate(uuid.uuid4().hex, prompt_ids=prompt, sampling_params=dict(
            temperature=0.0, top_p=1.0, top_k=-1, logprobs=False, max_tokens=5)) for _ in range(2)]
        return await asyncio.gather(*sampled), await asyncio.gather(*greedy)

    sampled, greedy = asyncio.run(run())
    for out in sampled:
        assert type(out).__name__ == "TokenOutput"
        assert 1 <= len(out.token_ids) <= RESPONSE_LEN and len(out.log_probs) == len(out.token_ids)
        assert all(lp <= 0.0 for lp in out.log_probs)
        assert out.stop_reason in ("completed", "length")
        assert "min_global_steps" in out.extra_fields
    # n samples of one prompt get distinct per-request seeds
    assert len({tuple(o.token_ids) for o in sampled}) > 1
    assert greedy[0].token_ids == greedy[1].token_ids and greedy[0].log_probs is None
    assert greedy[0].token_ids == _hf_greedy(tiny_llama_with_tokenizer, prompt, 5)


def test_agent_loop_worker_builds_dataproto(pat_stack, tiny_llama_with_tokenizer):
    import numpy as np
    from verl import DataProto
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    kind, cfg, manager = pat_stack
    worker = AgentLoopWorker(cfg, manager.get_client())
    prompts = [[{"role": "user", "content": t}] for t in ("What is 1 + 2?", "Solve 3x + 5 = 20.", "Find x.")]
    batch = DataProto.from_dict(non_tensors={"raw_prompt": np.array(prompts, dtype=object),
                                             "index": np.arange(len(prompts))})
    out = asyncio.run(worker.generate_sequences(batch))
    b = out.batch
    n = len(prompts)
    assert b["prompts"].shape == (n, PROMPT_LEN) and b["responses"].shape == (n, RESPONSE_LEN)
    seq_shape = (n, PROMPT_LEN + RESPONSE_LEN)
    assert b["input_ids"].shape == b["attention_mask"].shape == b["position_ids"].shape == seq_shape
    assert b["response_mask"].shape == b["rollout_log_probs"].shape == (n, RESPONSE_LEN)
    resp_len = b["attention_mask"][:, PROMPT_LEN:].sum(-1)
    assert (resp_len >= 1).all() and (b["response_mask"].sum(-1) == resp_len).all()
    # log-probs: negative on response tokens, zero on padding
    lp, mask = b["rollout_log_probs"], b["response_mask"].bool()
    assert (lp[mask] <= 0).all() and (lp[mask] < 0).any() and (lp[~mask] == 0).all()
    # prompts are left padded and equal the chat-templated prompt
    for i, p in enumerate(prompts):
        ids = _chat_prompt_ids(tiny_llama_with_tokenizer, p[0]["content"])
        assert b["prompts"][i, PROMPT_LEN - len(ids):].tolist() == ids
        assert b["attention_mask"][i, :PROMPT_LEN].sum() == len(ids)
    assert len(out.meta_info["metrics"]) == n
    assert list(out.non_tensor_batch["min_global_steps"]) == list(out.non_tensor_batch["max_global_steps"])


def test_weight_update_through_server_adapter(pat_stack, tiny_llama_with_tokenizer, tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM

    from pat_rollout.models import make_tiny_model
    from pat_rollout.verl.replica import collect_pat_metrics
    from pat_rollout.verl.rollout import ServerAdapter

    kind, cfg, manager = pat_stack
    model_b = str(make_tiny_model(tmp_path_factory.mktemp("llama_b"), "llama", seed=1))
    prompt = _chat_prompt_ids(tiny_llama_with_tokenizer, "What is 1 + 2?")
    expected_a = _hf_greedy(tiny_llama_with_tokenizer, prompt, RESPONSE_LEN)
    expected_b = _hf_greedy(model_b, prompt, RESPONSE_LEN)
    assert expected_a != expected_b
    state_dict = AutoModelForCausalLM.from_pretrained(model_b, dtype=torch.float32).state_dict()

    rollout_cfg, model_cfg = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model
    adapters = [ServerAdapter(rollout_cfg, model_cfg, None, replica_rank=r) for r in range(NUM_WORKERS[kind] // TP)]
    assert all(a.is_leader_rank for a in adapters)
    client = manager.get_client()
    greedy = dict(temperature=0.0, top_p=1.0, top_k=-1, logprobs=True)

    async def generate_all():
        return await asyncio.gather(*[client.generate(uuid.uuid4().hex, prompt_ids=prompt,
                                                      sampling_params=dict(greedy)) for _ in range(4)])

    async def sync(adapter):
        # verl's hybrid order: sleep (after generation) -> resume weights -> update -> resume kv_cache
        await adapter.release()
        await adapter.resume(["weights"])
        await adapter.update_weights(iter(state_dict.items()), global_steps=7)
        await adapter.resume(["kv_cache"])

    before = asyncio.run(generate_all())
    assert all(o.token_ids == expected_a for o in before)
    for a in adapters:
        a.bucket_bytes = 64 << 10  # several buckets per sync

    async def sync_all():
        await asyncio.gather(*[sync(a) for a in adapters])

    asyncio.run(sync_all())
    after = asyncio.run(generate_all())
    assert all(o.token_ids == expected_b for o in after), [o.token_ids for o in after]
    assert {o.extra_fields["global_steps"] for o in after} == {7}
    metrics = asyncio.run(collect_pat_metrics(manager.get_replicas()))
    print(f"PAT stage metrics ({kind}):", metrics)
    assert "pat/gen_time_s" in metrics and "pat/gen_time_s/max" in metrics
