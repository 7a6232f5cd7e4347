"""Shared fixtures: tiny local models and one local Ray cluster per test session.

Markers: slow (multi-process, still run in CI), ray (starts actors), verl (needs verl),
sglang (needs sglang), gpu (needs CUDA; skipped here), sglang_version (set from tests/sglang_versions.py: the SGLang
tests whose verdict can depend on the SGLang version; `--sglang-version-tests` runs only those of tests/sglang_backend).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--sglang-version-tests", action="store_true",
                     help="in tests/sglang_backend, run only the tests marked sglang_version (tests/sglang_versions.py): "
                          "make test-verl-sglang runs them on verl's SGLang pin")


def pytest_configure(config: pytest.Config) -> None:
    for line in (
        "slow: multi-process test (runs in CI, bounded)",
        "ray: starts Ray actors",
        "verl: needs verl installed",
        "sglang: needs sglang installed",
        "gpu: needs CUDA",
        "sglang_version: its verdict can depend on the SGLang version (also run on 0.5.12; tests/sglang_versions.py)",
    ):
        config.addinivalue_line("markers", line)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _select_sglang_version_tests(config, items)
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _select_sglang_version_tests(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests named in sglang_versions.BOTH_VERSIONS; with --sglang-version-tests deselect the other tests of
    tests/sglang_backend and those of tests/verl named in VERL_ONCE (everything else stays)."""
    from sglang_versions import BOTH_VERSIONS, MARKER, VERL_ONCE, selects

    only = config.getoption("--sglang-version-tests")
    keep, dropped, used = [], [], set()
    for item in items:
        folder = item.path.parent.name
        names = (item.path.name, item.name, getattr(item, "originalname", item.name))
        keys = {k for k in BOTH_VERSIONS if folder == "sglang_backend" and selects(k, *names)}
        once = {k for k in VERL_ONCE if folder == "verl" and selects(k, *names)}
        used |= keys | once
        if keys:
            item.add_marker(MARKER)
        drop = only and ((folder == "sglang_backend" and not keys) or once)
        (dropped if drop else keep).append(item)
    if only and (unused := sorted((set(BOTH_VERSIONS) | set(VERL_ONCE)) - used)):  # a renamed test or id
        raise pytest.UsageError(f"tests/sglang_versions.py names tests that were not collected: {unused}")
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


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
