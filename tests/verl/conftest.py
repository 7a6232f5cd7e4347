"""Helpers for the verl integration tests: Hydra compose of verl's ppo_trainer config, tiny model + tokenizer."""

from __future__ import annotations

import os

import pytest

VERL_CONFIG_DIR = None


def compose_ppo(overrides: list[str], config_dir: str | None = None, config_name: str = "ppo_trainer"):
    """Compose verl's trainer config (or a plug-in YAML that builds on it) with Hydra overrides."""
    from hydra import compose, initialize_config_dir

    verl = pytest.importorskip("verl")
    config_dir = config_dir or os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name=config_name, overrides=overrides)


@pytest.fixture(scope="session")
def tiny_llama_with_tokenizer(tiny_models: dict[str, str]) -> str:
    """The session's tiny Llama checkpoint with a tiny chat tokenizer saved next to it."""
    from pat_rollout.models.tokenizer import make_tiny_tokenizer

    return str(make_tiny_tokenizer(tiny_models["llama"]))
