"""Real SGLang engines on CPU (tiny Llama, TP=1 and TP=2) against HF transformers, plus the recompute recipe.

Every engine here is a real `sglang.Engine` (scheduler processes, radix cache, torch_native attention,
gloo all-reduce at TP=2) running in float32 with the sgl_kernel CPU stand-in when needed.
"""

from __future__ import annotations

import pytest

# "sglang.srt": a bare "sglang" could resolve to a namespace package of a same-named folder on sys.path.
pytest.importorskip("sglang.srt")

from pat_rollout.types import Request, SamplingParams  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

PROMPTS = [(1, 5, 17, 33, 9), (1, 100, 42, 7, 8, 200, 3, 11), (1, 2, 3)]
MAX_NEW = 16
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def llama_engine(request, tiny_models):
    from pat_rollout.sglang.engine import SGLangEngine

    eng = SGLangEngine(tiny_models["llama"], tp_size=request.param, watchdog_timeout=120)
    yield eng
    eng.shutdown()


def test_greedy_equals_hf(llama_engine, tiny_models, hf_reference):
    sp = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    llama_engine.add_requests(Request(request_id=f"p{i}", prompt_token_ids=p, sampling=sp)
                              for i, p in enumerate(PROMPTS))
    outs = {o.request_id: o for o in llama_engine.run_to_completion()}
    assert sorted(outs) == [f"p{i}" for i in range(len(PROMPTS))]
    for i, p in enumerate(PROMPTS):
        ref_ids, ref_lps = hf_reference(tiny_models["llama"], list(p), MAX_NEW)
        o = outs[f"p{i}"]
        assert o.finish_reason == "length"
        assert list(o.token_ids) == ref_ids, (llama_engine.tp_size, p)
        assert o.log_probs == pytest.approx(ref_lps, abs=LOGPROB_ATOL)


def test_stream_chunks_carry_only_new_tokens(llama_engine, monkeypatch):
    """launch.server_kwargs turns on SGLang's incremental streaming: the chunks of a request together hold each
    generated token and log-prob once (a cumulative stream hands over O(L^2) items), and add up to the output."""
    sizes: list[tuple[int, int]] = []
    generate = llama_engine.sgl.async_generate

    async def spy(*args, **kwargs):
        gen = await generate(*args, **kwargs)

        async def chunks():
            async for c in gen:
                sizes.append((len(c["output_ids"]), len(c["meta_info"]["output_token_logprobs"])))
                yield c
        return chunks()

    monkeypatch.setattr(llama_engine.sgl, "async_generate", spy)
    num_new = 3 * MAX_NEW
    llama_engine.add_requests([Request(request_id="s0", prompt_token_ids=PROMPTS[0],
                                       sampling=SamplingParams(max_new_tokens=num_new, ignore_eos=True))])
    (out,) = llama_engine.run_to_completion()
    assert len(out.token_ids) == len(out.log_probs) == num_new and out.finish_reason == "length"
    assert len(sizes) > 1, sizes
    assert sum(n for n, _ in sizes) == sum(n for _, n in sizes) == num_new, sizes


def test_resubmit_prompt_plus_generated_continues_exactly(llama_engine):
    """The recompute recipe at the SGLang API level: prompt + k generated tokens with max_new_tokens - k
    reproduces the rest; logprob_start_len=len(prompt) - 1 re-scores the carried tokens under this engine."""
    sgl = llama_engine.sgl
    prompt, k = [1, 100, 42, 7, 8], 6
    params = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}
    full = sgl.generate(input_ids=prompt, sampling_params=params, return_logprob=True)
    full_ids = full["output_ids"]
    full_lps = [x[0] for x in full["meta_info"]["output_token_logprobs"]]
    cont = sgl.generate(input_ids=prompt + full_ids[:k], sampling_params={**params, "max_new_tokens": MAX_NEW - k},
                        return_logprob=True, logprob_start_len=len(prompt) - 1)
    assert full_ids[:k] + cont["output_ids"] == full_ids
    cont_lps = [x[0] for x in cont["meta_info"]["output_token_logprobs"]]
    assert cont_lps == pytest.approx(full_lps[k:], abs=LOGPROB_ATOL)
    # input_token_logprobs from position len(prompt) - 1: SGLang gives the first entry (the last prompt
    # token) no log-prob; the next k entries re-score the carried tokens under this engine.
    carried = cont["meta_info"]["input_token_logprobs"]
    assert carried[0][0] is None and carried[0][1] == prompt[-1]
    assert [tid for _lp, tid, _t in carried[1:k + 1]] == full_ids[:k]
    assert [lp for lp, _tid, _t in carried[1:k + 1]] == pytest.approx(full_lps[:k], abs=LOGPROB_ATOL)
