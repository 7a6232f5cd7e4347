"""Test-only spy on SGLang's memory-saver regions inside SglPool scheduler processes (`PAT_SGLANG_MEMORY_SPY=1`).

`release_memory_occupation(tags)` frees exactly what was allocated inside `memory_saver_adapter.region(tag)`
(torch_memory_saver hooks the CUDA allocator there). On CPU the saver is a no-op, so the spy records instead:
every `TorchMemorySaverAdapter` SGLang creates is wrapped, and while one of its regions is open a dispatch mode
notes the storage of every tensor an op returns (and `UntypedStorage.resize_`, which reallocates without going
through the dispatcher) under the region's tag. The recorded storages are kept alive, so no later allocation can
reuse their addresses and pass for one of them. `pat_memory_regions` then says which live parameters and KV
buffers sit in storage allocated outside the region that should hold them. Off unless the variable is set.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import torch

SPY_ENV = "PAT_SGLANG_MEMORY_SPY"

_open_tags: list[str] = []
_inside: dict[int, tuple[str, Any]] = {}  # storage data_ptr -> (region tag, the storage, kept alive)


def _mark(storage: Any) -> None:
    ptr = storage.data_ptr()
    if ptr and _open_tags:
        _inside[ptr] = (_open_tags[-1], storage)


def _region_of(t: torch.Tensor) -> str | None:
    entry = _inside.get(t.untyped_storage().data_ptr())
    return entry[0] if entry else None


def install() -> bool:
    if os.environ.get(SPY_ENV) != "1":
        return False
    from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class AllocSpy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.layout == torch.strided:
                    _mark(t.untyped_storage())
            return out

    class SpyAdapter:
        def __init__(self, inner: Any) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

        @contextlib.contextmanager
        def region(self, tag: str, enable_cpu_backup: bool = False):
            with self._inner.region(tag, enable_cpu_backup=enable_cpu_backup):
                _open_tags.append(tag)
                try:
                    with AllocSpy():
                        yield
                finally:
                    _open_tags.pop()

    orig_create = TorchMemorySaverAdapter.create
    TorchMemorySaverAdapter.create = staticmethod(lambda enable: SpyAdapter(orig_create(enable)))
    orig_resize = torch.UntypedStorage.resize_

    def resize_(self, size):
        _inside.pop(self.data_ptr(), None)  # the old bytes are freed; the new ones count only inside a region
        out = orig_resize(self, size)
        _mark(self)
        return out

    torch.UntypedStorage.resize_ = resize_
    return True


def pat_memory_regions(self, path: str) -> None:
    """Which live parameters are not in the "weights" region and which KV buffers not in "kv_cache" (this rank)."""
    from pat_rollout.sglang import pool_hooks

    runner = self.tp_worker.model_runner
    params = dict(runner.model.named_parameters())
    pool = runner.token_to_kv_pool
    kv = list(pool.k_buffer) + list(pool.v_buffer)
    report = dict(spy=os.environ.get(SPY_ENV) == "1", num_params=len(params), num_kv_buffers=len(kv),
                  params_outside=sorted(n for n, p in params.items() if _region_of(p) != "weights"),
                  kv_outside=[i for i, t in enumerate(kv) if _region_of(t) != "kv_cache"])
    with open(f"{path}.rank{pool_hooks.STATE.rank}.json", "w") as f:
        json.dump(report, f)


RPC_METHODS = {"pat_memory_regions": pat_memory_regions}
