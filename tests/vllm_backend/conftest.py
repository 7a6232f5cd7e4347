"""vLLM CPU tests (`make test-vllm`, the vLLM venv): every module here skips where vllm is not installed.

vLLM's CPU attention supports head sizes from 32 up (`CPUAttentionBackend.get_supported_head_sizes`), so the
tiny Llama here is the shared preset widened to head_dim 32 (4 heads, 2 KV heads: TP2 splits the KV heads).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV per engine
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from pat_rollout.models import make_tiny_model

    # 4096 positions: room for a request that outlives every test step (test_vllm_pool_switch.LONG)
    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "llama32", "llama", hidden_size=128, head_dim=32,
                               max_position_embeddings=4096))
