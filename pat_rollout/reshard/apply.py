"""Execute a WeightPlan on one device's local shards, plus tensor-only shard/unshard helpers.

Grow steps (the device only keeps slices of what it holds) run in place: kept slices are compacted to
the front of the existing storage, the tensor object is re-viewed at its new shape, and the storage is
then shrunk. Other steps allocate the new shard, copy kept slices and receive the rest via a Transport.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from pat_rollout.comm.transport import Transport
from pat_rollout.layout.shard import ShardSpec, shard_intervals
from pat_rollout.layout.transition import WeightPlan, WeightTransfer

# A memmove with a gap smaller than 1/_MAX_CHUNKS of its length goes through a temporary copy
# instead of that many non-overlapping chunks.
_MAX_CHUNKS = 64


def shard(full: torch.Tensor, spec: ShardSpec, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The local shard of `full` held by `tp_rank` of `tp_size` (a new tensor; replicated specs clone)."""
    if spec.dim is None:
        return full.clone()
    pieces = [full.narrow(spec.dim, lo, hi - lo) for lo, hi in shard_intervals(spec, tp_rank, tp_size)]
    return torch.cat(pieces, dim=spec.dim)


def unshard(locals_: Sequence[torch.Tensor], spec: ShardSpec, tp_size: int) -> torch.Tensor:
    """Rebuild the full tensor from the shards of ranks 0..tp_size-1 (replicated pieces taken from any)."""
    if len(locals_) != tp_size:
        raise ValueError(f"{spec.name}: got {len(locals_)} shards for tp_size={tp_size}")
    if spec.dim is None:
        return locals_[0].clone()
    full = locals_[0].new_empty(spec.shape)
    for rank, local in enumerate(locals_):
        off = 0
        for lo, hi in shard_intervals(spec, rank, tp_size):
            full.narrow(spec.dim, lo, hi - lo).copy_(local.narrow(spec.dim, off, hi - lo))
            off += hi - lo
    return full


def reshard_local(shards: dict[str, torch.Tensor], plan: WeightPlan, device: int, transport: Transport,
                  *, release_memory: bool = True, keep_storage: bool = False) -> dict[str, torch.Tensor]:
    """Turn `device`'s shards under `plan.src` into its shards under `plan.dst`; returns name -> tensor.

    Every device of the plan must call this concurrently with its own transport endpoint. Parameters not
    in the plan (replicated) are returned unchanged. A parameter the device only keeps slices of (grow)
    is compacted in place inside its own storage; the returned tensor is the same object (nn.Parameters
    stay bound). With `release_memory` its storage is then resized to the new size when the tensor owns
    the whole storage; note that resize_ moves the bytes into a fresh smaller allocation (on CPU and
    CUDA alike), so peak extra memory is one new shard of one parameter. Other parameters get new tensors
    and the engine must rebind them.

    With `keep_storage` every parameter stays the same tensor object at the same address (what a captured CUDA
    graph needs): nothing is released, and a shard that is not a compaction of the old one (a shrink's receives)
    is assembled in a temporary and copied into the old storage, which must be large enough (it is whenever the
    storage once held a shard at least that large: the pool's base layout holds the largest).
    """
    if keep_storage:
        release_memory = False
    if transport.device != device:
        raise RuntimeError(f"transport is for device {transport.device}, reshard_local called for device {device}")
    _, old_rank = plan.src.position(device)
    _, new_rank = plan.dst.position(device)
    keeps: dict[str, list[WeightTransfer]] = {}
    recvs: dict[str, list[WeightTransfer]] = {}
    sends: dict[str, list[WeightTransfer]] = {}
    for t in plan.transfers_for(device):
        table = keeps if t.is_local else (recvs if t.dst_device == device else sends)
        table.setdefault(t.name, []).append(t)
    out = dict(shards)
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        for spec in plan.specs:
            old = shards[spec.name]
            expected = spec.local_shape(old_rank, plan.src.tp_size)
            if tuple(old.shape) != expected:
                raise RuntimeError(f"device {device}: {spec.name} has shape {tuple(old.shape)}, plan {plan.src} -> "
                                   f"{plan.dst} expects {expected} at old tp_rank {old_rank}")
            dim = spec.dim
            assert dim is not None
            for t in sends.get(spec.name, []):
                transport.submit_send(old.narrow(dim, t.src_offset, t.length).contiguous(), t.dst_device, t.task_id)
            new_shape = spec.local_shape(new_rank, plan.dst.tp_size)
            mine = keeps.get(spec.name, [])
            if spec.name not in recvs and spec.name not in sends and _can_compact(old, mine):
                out[spec.name] = _compact_in_place(old, dim, mine, new_shape, release_memory)
                continue
            new = old.new_empty(new_shape)
            for t in mine:
                new.narrow(dim, t.dst_offset, t.length).copy_(old.narrow(dim, t.src_offset, t.length))
            for t in recvs.get(spec.name, []):
                view = new.narrow(dim, t.dst_offset, t.length)
                buf = view if view.is_contiguous() else torch.empty_like(view, memory_format=torch.contiguous_format)
                transport.submit_recv(buf, t.src_device, t.task_id)
                if buf is not view:
                    pending.append((view, buf))
            out[spec.name] = new
        transport.run()
        for view, buf in pending:
            view.copy_(buf)
        if keep_storage:
            for name, new in list(out.items()):
                old = shards[name]
                if new is not old:
                    out[name] = copy_into_storage(old, new, name)
    return out


def copy_into_storage(old: torch.Tensor, new: torch.Tensor, name: str) -> torch.Tensor:
    """`old`, re-viewed contiguously with `new`'s shape at its own storage offset, holding `new`'s values (which
    may live on another device): the same tensor object at the same address."""
    storage = old.untyped_storage()
    need = (old.storage_offset() + new.numel()) * old.element_size()
    if storage.nbytes() < need:
        raise RuntimeError(f"{name}: keep_storage needs {need} bytes at its address, its storage has "
                           f"{storage.nbytes()} (it never held a shard of shape {tuple(new.shape)})")
    with torch.no_grad():
        old.set_(storage, old.storage_offset(), tuple(new.shape), _contiguous_strides(tuple(new.shape)))
        old.copy_(new)
    return old


def _can_compact(old: torch.Tensor, keeps: list[WeightTransfer]) -> bool:
    """In place is safe when every kept slice moves towards the front, in the same order as it was stored."""
    if not old.is_contiguous():
        return False
    by_src = sorted(keeps, key=lambda t: t.src_offset)
    return all(t.dst_offset <= t.src_offset for t in keeps) and by_src == sorted(keeps, key=lambda t: t.dst_offset)


def _compact_in_place(t: torch.Tensor, dim: int, keeps: list[WeightTransfer], new_shape: tuple[int, ...],
                      release_memory: bool) -> torch.Tensor:
    # View the tensor as [outer, width, inner] with width the sharded dim. New row i starts at
    # i*w_new*inner <= i*w_old*inner, so rows are processed front to back; a block of rows [i, j) can be
    # copied with plain copies once j*w_new <= i*w_old (its writes end before its reads begin).
    outer, inner = math.prod(t.shape[:dim]), math.prod(t.shape[dim + 1 :])
    w_old, w_new = t.shape[dim], new_shape[dim]
    flat = t.view(-1)
    pieces = sorted(keeps, key=lambda k: k.src_offset)
    if w_new == w_old and all(k.src_offset == k.dst_offset for k in pieces):
        return t
    i = 0
    while i < outer:
        j = min(outer, i * w_old // w_new) if w_new else outer
        if j > i:
            src = flat[i * w_old * inner : j * w_old * inner].view(j - i, w_old, inner)
            dst = flat[i * w_new * inner : j * w_new * inner].view(j - i, w_new, inner)
            for k in pieces:
                dst[:, k.dst_offset : k.dst_offset + k.length].copy_(src[:, k.src_offset : k.src_offset + k.length])
            i = j
        else:
            for k in pieces:
                _memmove(flat, (i * w_old + k.src_offset) * inner, (i * w_new + k.dst_offset) * inner, k.length * inner)
            i += 1
    storage = t.untyped_storage()
    t.set_(storage, t.storage_offset(), new_shape, _contiguous_strides(new_shape))
    new_nbytes = t.numel() * t.element_size()
    if release_memory and t.storage_offset() == 0 and storage.nbytes() == outer * w_old * inner * t.element_size():
        storage.resize_(new_nbytes)
    return t


def _memmove(flat: torch.Tensor, src: int, dst: int, n: int) -> None:
    """Copy flat[src:src+n] to flat[dst:dst+n] for dst <= src, correct when the ranges overlap."""
    gap = src - dst
    assert gap >= 0
    if gap == 0 or n == 0:
        return
    if gap >= n:
        flat[dst : dst + n].copy_(flat[src : src + n])
    elif n // gap > _MAX_CHUNKS:
        flat[dst : dst + n].copy_(flat[src : src + n].clone())
    else:
        # Chunks of `gap` elements never overlap their source, and each write lands before later sources.
        for off in range(0, n, gap):
            c = min(gap, n - off)
            flat[dst + off : dst + off + c].copy_(flat[src + off : src + off + c])


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))
