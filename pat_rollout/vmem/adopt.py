"""Adopt live storages into a mapper's reserved ranges: what makes a `ReclaimPlan` move real memory.

`adopt` takes a plan whose addresses the mapper reserved (weight storages and KV regions), and for each storage in
turn maps its base extent (one handle per weight granule, as `map_initial`; one handle for a KV region's base),
copies the existing storage's bytes in, and re-points the tensors at the mapped memory: a parameter keeps its
`nn.Parameter` object (`param.data = ...` over the new storage, same offset, shape and strides), a KV storage is
handed to the caller's `repoint_kv`. One storage at a time: the old one is dropped (freed once nothing else holds
it) before the next is copied, so the extra memory at the peak is one storage.

Device-agnostic: `view(va, nbytes)` returns a torch uint8 tensor over mapped memory (`vmem.host.torch_bytes` on the
CPU with a `HostMapper`, `vmem.cuda.torch_bytes` on CUDA with a `CudaMapper`). Imports torch lazily (the package
stays stdlib at import)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pat_rollout.vmem.mapper import Mapper
from pat_rollout.vmem.plan import ReclaimError, ReclaimPlan, WeightStorage, align_up


def _bytes_of(storage):
    import torch

    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def adopt(plan: ReclaimPlan, mapper: Mapper, view: Callable[[int, int], object], params: Sequence[Sequence[object]],
          kv: list, repoint_kv: Callable[[int, object, object], None]) -> dict[int, int]:
    """`params[i]`: the parameters (or tensors) sharing plan.weights[i]'s storage (the first one's storage is copied;
    each keeps its offset, shape and strides). `kv[j]`: the untyped storage plan.kv[j] replaces;
    `repoint_kv(j, old_storage, new_storage)` re-points the caller's buffers (new_storage spans the whole reserved
    range; only its base is mapped); `kv[j]` is set to None once re-pointed (so the old storage can be freed before the
    next is copied). Returns weight page address -> handle (what `apply_switch` moves), as `map_initial`.
    `adopt_weights` then `adopt_kv` (the SGLang pool runs them apart: weights right after the model is loaded, KV
    once SGLang allocated its pool)."""
    if len(params) != len(plan.weights) or len(kv) != len(plan.kv):
        raise ReclaimError(f"adopt: {len(params)} parameter groups / {len(kv)} KV storages for a plan of "
                           f"{len(plan.weights)} weight storages / {len(plan.kv)} KV regions")
    handles = adopt_weights(plan.weights, plan.granule, mapper, view, params)
    adopt_kv(plan, mapper, view, kv, repoint_kv)
    return handles


def adopt_weights(weights: Sequence[WeightStorage], granule: int, mapper: Mapper, view: Callable[[int, int], object],
                  params: Sequence[Sequence[object]]) -> dict[int, int]:
    """The weight half of `adopt`: each storage mapped one handle per granule at its reserved `start`, copied in and
    its tensors re-pointed, the old storage dropped before the next. Returns weight page address -> handle."""
    import torch

    if len(params) != len(weights):
        raise ReclaimError(f"adopt: {len(params)} parameter groups for {len(weights)} weight storages")
    g = granule
    handles: dict[int, int] = {}
    for w, group in zip(weights, params):
        old = group[0].untyped_storage()
        if old.nbytes() != w.nbytes or any(p.untyped_storage().data_ptr() != old.data_ptr() for p in group):
            raise ReclaimError(f"adopt: weight {w.name}: the tensors do not share one storage of {w.nbytes} B")
        n = align_up(w.nbytes, g)
        for va in range(w.start, w.start + n, g):
            handles[va] = mapper.create(g)
            mapper.map(va, handles[va])
        new = view(w.start, n)
        with torch.no_grad():
            new[: w.nbytes].copy_(_bytes_of(old))
            sto = new.untyped_storage()
            for p in group:
                t = torch.empty(0, dtype=p.dtype, device=p.device).set_(sto, p.storage_offset(), p.shape, p.stride())
                if isinstance(p, torch.nn.Parameter):
                    p.data = t
                else:
                    p.set_(sto, p.storage_offset(), p.shape, p.stride())
        del old, new, sto
        _give_back()
    return handles


def adopt_kv(plan: ReclaimPlan, mapper: Mapper, view: Callable[[int, int], object], kv: list,
             repoint_kv: Callable[[int, object, object], None]) -> None:
    """The KV half of `adopt`: each region's base mapped with one handle, the old storage copied in, re-pointed
    through `repoint_kv` and dropped (`kv[j] = None`) before the next."""
    import torch

    if len(kv) != len(plan.kv):
        raise ReclaimError(f"adopt: {len(kv)} KV storages for a plan of {len(plan.kv)} KV regions")
    for j, r in enumerate(plan.kv):
        old = kv[j]
        if old.nbytes() > r.base_bytes:
            raise ReclaimError(f"adopt: KV storage {j} of {old.nbytes()} B exceeds its region's base "
                               f"{r.base_bytes} B")
        if r.base_bytes:
            mapper.map(r.start, mapper.create(r.base_bytes))
        new = view(r.start, r.reserved_bytes)
        with torch.no_grad():
            new[: old.nbytes()].copy_(_bytes_of(old))
        repoint_kv(j, old, new.untyped_storage())
        kv[j] = None
        del new, old
        _give_back()


def _give_back() -> None:
    """On CUDA, hand the storage just dropped back to the device: torch's caching allocator would keep it, and the
    next storage's pages come from `cuMemCreate`, outside that allocator, out of what the device has free (little,
    next to SGLang's static memory fraction). Only whole cached segments go back: an old storage that shared a
    segment with a live tensor stays cached, which only a GPU run can measure (tests/gpu/test_vmem_gpu.py). On the
    CPU the storage is freed when dropped."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()

