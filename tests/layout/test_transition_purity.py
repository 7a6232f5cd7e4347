"""The planning modules of this slice import no torch, ray or sglang (STYLE rule 2)."""

from __future__ import annotations

import subprocess
import sys

PURE = ["pat_rollout.layout", "pat_rollout.layout.transition", "pat_rollout.reshard.plan", "pat_rollout.kv",
        "pat_rollout.kv.plan", "pat_rollout.kv.cost"]


def test_pure_modules_import_no_heavy_deps() -> None:
    code = ("import importlib, sys\n"
            f"for m in {PURE!r}: importlib.import_module(m)\n"
            "print(sorted({'torch', 'ray', 'sglang'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
