"""SGLang CPU tests: put the `sgl_kernel` stand-in on the path when the real one cannot be imported.

Runs only in the SGLang venv (INSTALL.md); elsewhere every module here skips on `importorskip("sglang.srt")`
(not "sglang": a same-named folder on sys.path would import as a namespace package).
SGLang spawns its scheduler processes, so the stand-in goes into PYTHONPATH as well as sys.path.
"""

from __future__ import annotations

import functools

import pytest
from sgl_stub import STUB_DIR, install_stub_if_needed  # noqa: E402,F401


def hf_greedy(model_path: str, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Plain greedy decoding with HF transformers in float32 (no logits processors, no stop on EOS): tokens,
    log-probs. One prefill, then one token per forward over HF's KV cache (a full forward per token made the longest
    references ~10 s each); memoised per (model, prompt, length), since several tests check the same requests."""
    ids, lps = _hf_greedy_cached(model_path, tuple(prompt), max_new_tokens)
    return list(ids), list(lps)


@functools.cache
def _hf_greedy_cached(model_path: str, prompt: tuple[int, ...], max_new_tokens: int):
    import torch

    model = _hf_model(model_path)
    ids, lps = [], []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        for i in range(max_new_tokens):
            logp = torch.log_softmax(out.logits[0, -1].double(), -1)
            tok = int(logp.argmax())
            ids.append(tok)
            lps.append(float(logp[tok]))
            if i + 1 < max_new_tokens:
                out = model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return tuple(ids), tuple(lps)


_HF_CACHE: dict[str, object] = {}


def _hf_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    if path not in _HF_CACHE:
        _HF_CACHE[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _HF_CACHE[path]


@pytest.fixture(scope="session")
def hf_reference():
    return hf_greedy
