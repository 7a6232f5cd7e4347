"""Greedy RefEngine (TP=1, float64) reproduces HF transformers generate token for token."""

from __future__ import annotations

import pytest
from hf_reference import hf_greedy
from ref_helpers import make_engine, make_requests

from pat_rollout.models import make_tiny_model

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize("arch", ["llama", "qwen3", "llama3-rope"])
def test_greedy_matches_hf(arch, tiny_models, tmp_path_factory):
    if arch == "llama3-rope":  # Llama-3.1 frequency scaling; positions run past the original 32
        path = str(make_tiny_model(tmp_path_factory.mktemp("l3"), "llama", rope_parameters=LLAMA3_ROPE))
    else:
        path = tiny_models[arch]
    requests = make_requests([1, 5, 17, 33, 40], [12, 7, 20, 3, 16], prompt_seed=11)
    # block_size 4 makes sequences span many non-contiguous blocks.
    outputs = make_engine(path, block_size=4).generate(requests)
    expected = hf_greedy(path, requests)
    for out, (tokens, log_probs) in zip(outputs, expected):
        assert list(out.token_ids) == tokens, out.request_id
        # HF computes RMSNorm in fp32 even for fp64 models, so log-probs agree to ~1e-6, not 1e-12.
        assert out.log_probs == pytest.approx(log_probs, abs=2e-5)
        assert out.finish_reason == ("stop" if tokens[-1] == 2 else "length")
