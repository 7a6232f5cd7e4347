"""Peak bytes of tensor storage allocated inside a window, on any device (tests and benches).

`torch.cuda.max_memory_allocated` exists only on CUDA; this counts on CPU too. While a `AllocSpy` is entered (in the
thread that allocates: torch dispatch modes are per thread), every tensor an op returns whose storage was not seen
before adds its bytes to `live`; when that storage is freed (its Python object is preserved by torch while the
storage lives, so a weakref finalizer fires exactly then) they are subtracted. `UntypedStorage.resize_` bypasses the
dispatcher: it is counted as the new allocation alive next to the old one for the copy, then the old one freed.
`peak` is the largest `live` seen: the peak extra memory of the window. Storages allocated before the window
(parameters, KV pools) are not counted, nor buffers a library allocates without returning a tensor (gloo's).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any

import torch

_resize_lock = threading.Lock()
_resize_spies: list[AllocSpy] = []
_orig_resize = torch.UntypedStorage.resize_


def _resize(self, size):  # installed while any spy is entered
    old = self.nbytes()
    for spy in list(_resize_spies):
        if spy._thread == threading.get_ident():  # like the dispatch mode: the spy's own thread only
            spy._note_resize(self, old, size)
    return _orig_resize(self, size)


@contextlib.contextmanager
def _disable_spy_mode(spy: AllocSpy):
    from torch.utils._python_dispatch import _pop_mode_temporarily

    with _resize_lock:
        _resize_spies.remove(spy)
    try:
        with _pop_mode_temporarily() as mode:
            assert mode is spy._mode, "AllocSpy.paused() must be entered while the spy's mode is innermost"
            yield
    finally:
        with _resize_lock:
            _resize_spies.append(spy)


def _counted(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type != "meta" and t.layout == torch.strided


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class AllocSpy:
    """`with AllocSpy() as spy: ...` then `spy.peak` (bytes), `spy.allocated` (total bytes allocated)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.allocated = 0
        self._seen: dict[int, Any] = {}  # id(storage) -> finalizer
        self._mode = None
        self._thread = 0
        self._lock = threading.Lock()

    def _add(self, n: int) -> None:
        with self._lock:
            self.live += n
            self.allocated += max(0, n)
            self.peak = max(self.peak, self.live)

    def _track(self, storage: Any) -> None:
        key = id(storage)
        if key in self._seen or storage.nbytes() == 0:
            return
        n = storage.nbytes()
        self._add(n)
        self._seen[key] = weakref.finalize(storage, self._freed, key, n)

    def _freed(self, key: int, n: int) -> None:
        self._seen.pop(key, None)
        self._add(-n)

    def _note_resize(self, storage: Any, old: int, new: int) -> None:
        key = id(storage)
        self._add(new)  # the new bytes, while the old ones are copied over
        with self._lock:
            self.live -= old if key in self._seen else 0
        if key in self._seen:  # a storage we count: it now holds `new`
            self._seen.pop(key).detach()
            self._seen[key] = weakref.finalize(storage, self._freed, key, new)
        else:  # a storage from before the window: only the growth stays extra
            with self._lock:
                self.live -= new
                self.live += max(0, new - old)

    def __enter__(self) -> AllocSpy:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        spy = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                ins = [t for t in tree_leaves((args, kwargs)) if _counted(t)]
                inputs = {_ptr(t) for t in ins}
                for t in tree_leaves(out):
                    # views alias an input's storage; in-place results (set_ too) are an input
                    if _counted(t) and _ptr(t) not in inputs and not any(t is i for i in ins):
                        spy._track(t.untyped_storage())
                return out

        self._thread = threading.get_ident()
        self._mode = _Mode()
        self._mode.__enter__()
        with _resize_lock:
            _resize_spies.append(self)
            torch.UntypedStorage.resize_ = _resize
        return self

    @contextlib.contextmanager
    def paused(self):
        """Allocations inside are not counted (frees of counted storages still are)."""
        with _disable_spy_mode(self):
            yield

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        with _resize_lock:
            _resize_spies.remove(self)
            if not _resize_spies:
                torch.UntypedStorage.resize_ = _orig_resize
