"""`pat_rollout.sglang.inventory`: every SGLang name the backend touches resolves on the installed SGLang (run in
both venvs: 0.5.23 and 0.5.12), and a name taken away gives one error that names it and the installed version.

The SGLang imports run in a subprocess with the engine's environment (on 0.5.12, importing SGLang submodules in
the test process before an engine starts breaks later CPU engines, see README.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt")

from pat_rollout.sglang import inventory  # noqa: E402  (stdlib only at import time)

pytestmark = pytest.mark.sglang

ROOT = Path(__file__).resolve().parents[2]
PRELUDE = """
import json, os, sys
sys.path.insert(0, "tests")
from sgl_stub import install_stub_if_needed
install_stub_if_needed()
from pat_rollout.sglang.launch import engine_env
os.environ.update(engine_env(2, "cpu"))
from pat_rollout.sglang import inventory
"""


def _run(body: str) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", PRELUDE + body], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_name_resolves_on_the_installed_sglang():
    from importlib.metadata import version

    out = _run("inventory.check_static()\nprint(json.dumps(dict(version=inventory.installed_version(), "
               "missing=inventory.missing(inventory.STATIC))))")
    assert out == {"version": version("sglang"), "missing": []}
    assert version("sglang") in inventory.TESTED_VERSIONS


def test_moved_names_give_one_error_naming_each_and_the_version():
    out = _run("""
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.model_executor.model_runner import ModelRunner
# the last two: both versions' spellings of one need; each name deleted wherever in the MRO it is defined
for cls, name in ((Scheduler, "init_ipc_channels"), (RadixCache, "reset"),
                  (TpModelWorker, "init_attention_backends"), (ModelRunner, "init_attention_backend")):
    for k in cls.__mro__:
        if name in vars(k):
            delattr(k, name)
try:
    inventory.check_static()
except RuntimeError as e:
    print(json.dumps(dict(msg=str(e))))
else:
    print(json.dumps(dict(msg=None)))
""")
    msg = out["msg"]
    assert msg is not None, "check_static passed with names removed"
    from importlib.metadata import version

    assert "3 SGLang name(s) it uses moved or are missing" in msg and f"installed sglang {version('sglang')}" in msg
    assert "[sglang.srt.managers.scheduler:Scheduler.init_ipc_channels]  (used by pool_hooks._install_output_path" in msg
    assert "[sglang.srt.mem_cache.radix_cache:RadixCache.reset]" in msg
    assert ("[sglang.srt.managers.tp_worker:TpModelWorker.init_attention_backends] or "
            "[sglang.srt.model_executor.model_runner:ModelRunner.init_attention_backend]  (used by "
            "compat.reinit_attention)") in msg
    assert len([line for line in msg.splitlines() if line.startswith("  - ")]) == 3


@dataclass
class _Fields:
    required: int


def _old(self, tokens, sampling_seed=None):
    return None


def test_spellings_are_alternatives_and_plus_joins_names():
    """The resolution rules on plain objects (no SGLang): alternatives, " + ", dataclass fields, signatures."""
    sched = types.SimpleNamespace(ipc=types.SimpleNamespace(send=1), running_batch=None, fields=_Fields, fn=_old)
    needs = (
        inventory.Need(spellings=("s:ipc.send", "s:send_to_tokenizer"), used_by="one spelling there"),
        inventory.Need(spellings=("s:running_batch + s:fields.required + s:fn(sampling_seed)",), used_by="all there"),
        inventory.Need(spellings=("s:ipc.gone + s:running_batch", "s:fn(owns_attention)"), used_by="neither"),
    )
    assert inventory.check_live(needs, s=sched) == ["[s:ipc.gone] or [s:fn(owns_attention)]  (used by neither)"]
    with pytest.raises(ValueError, match="'module-or-root:attr.path'"):
        inventory.Need(spellings=("no_colon",), used_by="x")
