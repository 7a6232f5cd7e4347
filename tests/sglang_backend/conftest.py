"""SGLang CPU tests: put the `sgl_kernel` stand-in on the path when the real one cannot be imported.

Runs only in the SGLang venv (INSTALL.md); elsewhere every module here skips on `importorskip("sglang.srt")`
(not "sglang": a same-named folder on sys.path would import as a namespace package).
SGLang spawns its scheduler processes, so the stand-in goes into PYTHONPATH as well as sys.path.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

STUB_DIR = Path(__file__).parent / "sgl_kernel_stub"


def _real_sgl_kernel_importable() -> bool:
    if importlib.util.find_spec("sgl_kernel") is None:
        return False
    try:
        import sgl_kernel  # noqa: F401  (PyPI's wheel raises ImportError without libcuda)
    except ImportError:
        for name in [m for m in sys.modules if m == "sgl_kernel" or m.startswith("sgl_kernel.")]:
            del sys.modules[name]
        return False
    return True


def install_stub_if_needed() -> bool:
    """Prepend the stand-in to sys.path and PYTHONPATH unless the real sgl_kernel imports; True if installed."""
    if _real_sgl_kernel_importable():
        return False
    sys.path.insert(0, str(STUB_DIR))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(STUB_DIR), os.environ.get("PYTHONPATH")) if p)
    import sgl_kernel

    assert getattr(sgl_kernel, "IS_PAT_STUB", False), sgl_kernel.__file__
    return True


if importlib.util.find_spec("sglang") is not None and importlib.util.find_spec("sglang.srt") is not None:
    STUB_INSTALLED = install_stub_if_needed()


def hf_greedy(model_path: str, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Plain greedy decoding with HF transformers in float32 (no logits processors): tokens, log-probs."""
    import torch

    model = _hf_model(model_path)
    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)
            tok = int(logp.argmax())
            ids.append(tok)
            lps.append(float(logp[tok]))
    return ids[len(prompt):], lps


_HF_CACHE: dict[str, object] = {}


def _hf_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    if path not in _HF_CACHE:
        _HF_CACHE[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _HF_CACHE[path]


@pytest.fixture(scope="session")
def hf_reference():
    return hf_greedy
