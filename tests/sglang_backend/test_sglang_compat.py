"""The small pieces of `pat_rollout.sglang.compat` that can be checked without starting an engine.

Nothing here imports SGLang's submodules: on 0.5.12 they cache "not a CPU device" when imported before
`SGLANG_USE_CPU_ENGINE=1` is set, and later CPU engines in this process then fail to start."""

from __future__ import annotations

import pytest

# "sglang.srt": a bare "sglang" could resolve to a namespace package of a same-named folder on sys.path.
pytest.importorskip("sglang.srt")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.sglang


def test_torch_without_pinning_drops_only_pin_memory():
    from pat_rollout.sglang.compat import _torch_without_pinning

    shim = _torch_without_pinning()
    t = shim.tensor([3, 1, 2], dtype=torch.int64, pin_memory=True)
    assert torch.equal(t, torch.tensor([3, 1, 2])) and t.dtype == torch.int64
    assert shim.zeros is torch.zeros and shim.int64 is torch.int64  # everything else is torch's own
    assert torch.tensor is not shim.tensor  # torch itself is untouched

