"""Put the `sgl_kernel` CPU stand-in (tests/sglang_backend/sgl_kernel_stub) on the path when the real one
cannot be imported. Used by the conftests of every test directory that starts SGLang engines. SGLang spawns
its scheduler processes (and Ray starts actors), so the stand-in goes into PYTHONPATH as well as sys.path."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

STUB_DIR = Path(__file__).parent / "sglang_backend" / "sgl_kernel_stub"


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
