"""Print an installed distribution's requirements minus SGLang's GPU-only kernel packages, one per line.

The CPU test venvs (`make install-sglang`, `make install-verl-sglang`) install sglang with `--no-deps` and then
these requirements: the kernel wheels below hold CUDA binaries that cannot load without a GPU (the tests put a
PyTorch stand-in for `sgl_kernel` on the path instead), and together they are 2.5-3.5 GB of each venv, which a
CI machine's disk may not have. On a GPU, install sglang normally.

    python tests/sglang_cpu_requirements.py sglang > reqs.txt && pip install -r reqs.txt
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, requires

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# CUDA-only kernels and their CUDA-only helpers, as named in sglang 0.5.12 and 0.5.23's metadata.
GPU_ONLY = frozenset(
    {
        "flash-attn-4",
        "flashinfer-cubin",
        "flashinfer-python",
        "humming-kernels",
        "nvidia-cutlass-dsl",
        "nvidia-mathdx",
        "nvshmem4py-cu13",
        "quack-kernels",
        "sgl-deep-ep",
        "sgl-deep-gemm",
        "sgl-flash-mla",
        "sglang-kernel",
        "tilelang",
        "tokenspeed-mla",
    }
)


def cpu_requirements(dist: str, without: frozenset[str] = GPU_ONLY) -> list[str]:
    """`dist`'s unconditional requirements for this platform (no extras), minus the names in `without`."""
    try:
        reqs = requires(dist) or []
    except PackageNotFoundError:
        raise SystemExit(f"{dist} is not installed in {sys.prefix}; install it with --no-deps first") from None
    kept = []
    for line in reqs:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if canonicalize_name(req.name) in without:
            continue
        req.marker = None
        kept.append(str(req))
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dist", help="an installed distribution, e.g. sglang")
    args = parser.parse_args()
    print("\n".join(cpu_requirements(args.dist)))


if __name__ == "__main__":
    main()
