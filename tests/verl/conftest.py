"""Helpers for the verl integration tests: Hydra compose of verl's ppo_trainer config, tiny model + tokenizer."""

from __future__ import annotations

import pytest
import sgl_stub  # noqa: F401  (where SGLang is installed: its sgl_kernel CPU stand-in, for backend=sglang tests)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "verl_e2e: runs verl's main_ppo end to end (minutes; `make test` only)")


@pytest.fixture(scope="session")
def tiny_llama_with_tokenizer(tiny_models: dict[str, str]) -> str:
    """The session's tiny Llama checkpoint with a tiny chat tokenizer saved next to it."""
    from pat_rollout.models.tokenizer import make_tiny_tokenizer

    return str(make_tiny_tokenizer(tiny_models["llama"]))
