"""Hydra compose of verl's ppo_trainer config for the verl integration tests."""

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
