"""Shared fixtures: tiny local models and one local Ray cluster per test session.

Markers: slow (multi-process, still run in CI), ray (starts actors), verl (needs verl),
sglang (needs sglang), gpu (needs CUDA; skipped here).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config: pytest.Config) -> None:
    for line in (
        "slow: multi-process test (runs in CI, bounded)",
        "ray: starts Ray actors",
        "verl: needs verl installed",
        "sglang: needs sglang installed",
        "gpu: needs CUDA",
    ):
        config.addinivalue_line("markers", line)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Paths of tiny random Llama and Qwen3 checkpoints (GQA 4 heads / 2 KV heads)."""
    from pat_rollout.models import make_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {arch: str(make_tiny_model(root / arch, arch)) for arch in ("llama", "qwen3")}


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray instance shared by all Ray tests (start-up costs ~10 s)."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}})
    yield ray
    ray.shutdown()
