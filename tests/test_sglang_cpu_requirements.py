"""The CPU test venvs' requirement filter: sglang's own requirements minus its CUDA-only kernel wheels."""

from __future__ import annotations

import pytest
import sglang_cpu_requirements as scr

SGLANG_LIKE = [
    "torch==2.14.1",
    "sglang-kernel==0.4.10",
    "flashinfer_python==0.6.11",  # spelt with "_" in some metadata: still filtered
    "Tilelang==0.1.8",
    "transformers>=5.6",
    'uvloop; sys_platform == "linux"',
    'pywin32; sys_platform == "win32"',
    'pytest; extra == "test"',
]


def test_keeps_plain_requirements_and_drops_gpu_kernels_extras_and_other_platforms(monkeypatch):
    monkeypatch.setattr(scr, "requires", lambda dist: SGLANG_LIKE)
    kept = scr.cpu_requirements("sglang")
    assert kept == ["torch==2.14.1", "transformers>=5.6", "uvloop"]


def test_missing_distribution_says_how_to_install_it():
    with pytest.raises(SystemExit, match="no-such-dist-xyz is not installed.*--no-deps"):
        scr.cpu_requirements("no-such-dist-xyz")


def test_filter_list_names_the_kernels_of_both_tested_sglang_versions():
    # 0.5.12 and 0.5.23 pull these as hard requirements; each is a CUDA binary that cannot load on CPU.
    for name in ("sglang-kernel", "flashinfer-python", "flashinfer-cubin", "sgl-deep-gemm", "tokenspeed-mla"):
        assert name in scr.GPU_ONLY
