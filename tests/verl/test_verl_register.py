"""`import verl` alone (entry point, no env var) registers rollout.name=pat in both registries."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("verl")
pytestmark = pytest.mark.verl

SCRIPT = textwrap.dedent("""
    import verl
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class
    from pat_rollout.verl.replica import PatReplica
    from pat_rollout.verl.rollout import ServerAdapter
    assert get_rollout_class("pat", "async") is ServerAdapter, get_rollout_class("pat", "async")
    assert get_rollout_replica_class("pat") is PatReplica, get_rollout_replica_class("pat")
    print("PAT-REGISTERED")
""")


def _run(env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_MODULES", "VERL_USE_EXTERNAL_PLUGINS")}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120,
                          cwd="/")


def test_entry_point_is_installed():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="verl.plugins")}
    assert eps.get("pat") == "pat_rollout.verl.register", (
        f"verl.plugins entry point missing ({eps}); run `pip install -e . --no-deps`")


def test_import_verl_registers_pat_in_fresh_process():
    proc = _run({})
    assert proc.returncode == 0 and "PAT-REGISTERED" in proc.stdout, proc.stdout + proc.stderr


def test_register_module_imports_loudly():
    # verl swallows plug-in errors at DEBUG: load the module directly so a broken import fails this test.
    import importlib

    mod = importlib.import_module("pat_rollout.verl.register")
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    mod.register()  # idempotent
    assert _ROLLOUT_REGISTRY[("pat", "async")] == "pat_rollout.verl.rollout.ServerAdapter"
    assert RolloutReplicaRegistry.get("pat").__name__ == "PatReplica"


def test_plugins_disabled_means_not_registered():
    proc = _run({"VERL_USE_EXTERNAL_PLUGINS": "none"})
    assert proc.returncode != 0 and "Rollout pat with mode async not found" in proc.stderr, proc.stderr[-2000:]
