"""The pool on Ray actors equals HuggingFace transformers: DP=1, DP=2 x TP=1 and 1 x TP=2 (two actors,
gloo) all give HF's greedy tokens, and log-probs within tolerance (HF runs RMSNorm in fp32)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_reference import hf_greedy
from pool_helpers import pool_config, skewed_requests

from pat_rollout.driver import RolloutDriver

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_dp1_dp2_tp2_match_hf(ray_cluster, tiny_models, arch):
    torch.set_num_threads(1)
    # EOS stops a request here, as in HF generate
    requests = [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, ignore_eos=False))
                for r in skewed_requests(n=4, long_len=16, short_len=4)]
    expected = hf_greedy(tiny_models[arch], requests)
    for num_devices, tp in ((1, 1), (2, 1), (2, 2)):
        driver = RolloutDriver(pool_config(tiny_models[arch], policy="static", num_devices=num_devices,
                                           initial_tp=tp))
        try:
            outputs = driver.generate(requests)
        finally:
            driver.shutdown()
        for out, (tokens, log_probs) in zip(outputs, expected):
            assert list(out.token_ids) == tokens, (num_devices, tp, out.request_id)
            assert max(abs(a - b) for a, b in zip(out.log_probs, log_probs)) < 2e-5
