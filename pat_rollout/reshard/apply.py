"""Execute a WeightPlan on one device's local shards, plus tensor-only shard/unshard helpers.

Grow steps (the device only keeps slices of what it holds) run in place: kept slices are compacted to
the front of the existing storage, the tensor object is re-viewed at its new shape, and the storage is
then shrunk. Shrink steps run in place too: the tensor is expanded inside its storage and the rest received
straight into place. Transfers run in rounds bounded by `chunk_bytes`. Only mixed steps (keep some, receive
others into a smaller shard) allocate the new shard.
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


# Default bound on the scratch memory of one transfer round (and of a memmove's temporary), per device.
DEFAULT_CHUNK_BYTES = 64 << 20


def reshard_local(shards: dict[str, torch.Tensor], plan: WeightPlan, device: int, transport: Transport,
                  *, release_memory: bool = True, keep_storage: bool = False,
                  chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> dict[str, torch.Tensor]:
    """Turn `device`'s shards under `plan.src` into its shards under `plan.dst`; returns name -> tensor.

    Every device of the plan must call this concurrently with its own transport endpoint (and the same
    `chunk_bytes`). Parameters not in the plan (replicated) are returned unchanged.

    In place, the same tensor objects (nn.Parameters stay bound):
    - grow (the device only keeps slices of what it holds): kept slices are compacted to the front of the
      storage; with `release_memory` the storage is then resized to the new size when the tensor owns all of it
      (resize_ moves the bytes into a fresh smaller allocation: one new shard of one parameter at a time);
    - shrink (everything the device held is kept, the rest is received): the tensor is expanded inside its own
      storage, kept slices moved back to front to their new offsets, and received slices written straight into
      place. A storage too small for the new shard is first resized (`release_memory`: one parameter's new
      shard at a time); with `keep_storage` it must already be large enough (the pool's base layout held the
      largest shard), else the parameter takes the fallback below.
    Sends of an expanded parameter read the kept slices at their new offsets (what a device sends in a shrink
    is part of what it keeps). Transfers run in rounds of at most `chunk_bytes` (a transfer larger than that is
    split by rows), so scratch memory (non-contiguous slices, a memmove's overlap) stays within one chunk.

    Fallback (a transition neither pure grow nor pure shrink on this device, e.g. a grow that also receives):
    the new shard is allocated, kept slices copied, the rest received; with `keep_storage` it is then copied
    back into the old storage (same object, same address) and freed. With `keep_storage` nothing is released.
    """
    if keep_storage:
        release_memory = False
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes={chunk_bytes} must be >= 1")
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
    # name -> (tensor the sends read from, offset map old local -> its offset there); (tensor receives go into)
    send_from: dict[str, tuple[torch.Tensor, list[WeightTransfer] | None]] = {}
    recv_into: dict[str, torch.Tensor] = {}
    fallback: dict[str, tuple] = {}  # name -> (old, dim, keeps, new shape): new shard made when first needed
    with torch.no_grad():
        for spec in plan.specs:
            old = shards[spec.name]
            expected = spec.local_shape(old_rank, plan.src.tp_size)
            if tuple(old.shape) != expected:
                raise RuntimeError(f"device {device}: {spec.name} has shape {tuple(old.shape)}, plan {plan.src} -> "
                                   f"{plan.dst} expects {expected} at old tp_rank {old_rank}")
            dim = spec.dim
            assert dim is not None
            new_shape = spec.local_shape(new_rank, plan.dst.tp_size)
            mine = keeps.get(spec.name, [])
            my_sends, my_recvs = sends.get(spec.name, []), recvs.get(spec.name, [])
            if not my_recvs and not my_sends and _can_compact(old, mine):
                out[spec.name] = _compact_in_place(old, dim, mine, new_shape, release_memory)
                continue
            if _can_expand(old, dim, mine, my_sends, new_shape) and _has_room(old, new_shape, release_memory):
                scratch = max(1, chunk_bytes // old.element_size())
                out[spec.name] = _expand_in_place(old, dim, mine, new_shape, scratch)
                send_from[spec.name] = (old, mine)
                recv_into[spec.name] = old
                continue
            send_from[spec.name] = (old, None)
            fallback[spec.name] = (old, dim, mine, new_shape)
        specs = {sp.name: sp for sp in plan.specs}
        rounds = list(_rounds(plan, specs, {n: t.element_size() for n, t in shards.items()}, chunk_bytes))
        last: dict[str, int] = {}
        for i, rnd in enumerate(rounds):
            for _, t, _ in rnd:
                if t.dst_device == device or t.src_device == device:
                    last[t.name] = i
        # A fallback parameter's new shard lives from its first round to its last only (with keep_storage it is
        # then copied into the old storage and freed): one parameter at a time, not the whole model at once.
        for name in [n for n in fallback if n not in last]:
            out[name] = _finish_fallback(name, None, fallback[name], keep_storage)
        for i, rnd in enumerate(rounds):
            for name in {t.name for _, t, _ in rnd if t.dst_device == device} - recv_into.keys():
                recv_into[name] = _new_shard(*fallback[name])
            _run_round(rnd, specs, device, transport, send_from, recv_into)
            for name in [n for n in fallback if last.get(n) == i]:
                out[name] = _finish_fallback(name, recv_into.pop(name, None), fallback[name], keep_storage)
    return out


def _new_shard(old: torch.Tensor, dim: int, keeps: list[WeightTransfer], new_shape: tuple[int, ...]) -> torch.Tensor:
    new = old.new_empty(new_shape)
    for t in keeps:
        new.narrow(dim, t.dst_offset, t.length).copy_(old.narrow(dim, t.src_offset, t.length))
    return new


def _finish_fallback(name: str, new: torch.Tensor | None, how: tuple, keep_storage: bool) -> torch.Tensor:
    """A fallback parameter after its last round: its new shard (made now if it received nothing), or with
    `keep_storage` the old tensor holding it (the new shard is then freed when this returns)."""
    if new is None:
        new = _new_shard(*how)
    return copy_into_storage(how[0], new, name) if keep_storage else new


def _run_round(rnd, specs: dict, device: int, transport: Transport,
               send_from: dict[str, tuple[torch.Tensor, list[WeightTransfer] | None]],
               recv_into: dict[str, torch.Tensor]) -> None:
    """One round's sends and receives; its scratch (non-contiguous pieces) is freed when this returns."""
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    for piece_id, t, piece in rnd:
        dim = specs[t.name].dim
        if t.src_device == device:
            src, moved = send_from[t.name]
            view = _piece_view(src, dim, t.src_offset if moved is None else _kept_offset(moved, t), piece)
            transport.submit_send(view if view.is_contiguous() else view.contiguous(), t.dst_device, piece_id)
        elif t.dst_device == device:
            view = _piece_view(recv_into[t.name], dim, t.dst_offset, piece)
            if view.is_contiguous():
                transport.submit_recv(view, t.src_device, piece_id)
            else:
                buf = torch.empty_like(view, memory_format=torch.contiguous_format)
                transport.submit_recv(buf, t.src_device, piece_id)
                pending.append((view, buf))
    transport.run()
    for view, buf in pending:
        view.copy_(buf)


def _piece_view(t: torch.Tensor, dim: int, offset: int, piece: tuple[int, int, int, int]) -> torch.Tensor:
    """Rows [o0, o1) of the outer dims and [offset + a, offset + b) of `dim` of `t` (an [outer, w, inner] view)."""
    o0, o1, a, b = piece
    outer, inner = math.prod(t.shape[:dim]), math.prod(t.shape[dim + 1 :])
    return t.reshape(outer, t.shape[dim], inner)[o0:o1, offset + a : offset + b]


def _rounds(plan: WeightPlan, specs: dict, elem: dict[str, int], chunk_bytes: int):
    """The same schedule on every device: every transfer of the plan by parameter then task_id, split into pieces of at most
    `chunk_bytes` (along `dim` when there are no outer rows, else along the outer rows), grouped into rounds of at
    most `chunk_bytes`; a parameter some device may take the fallback for gets rounds of its own. Yields lists of (piece id, transfer, (o0, o1, a, b)); the piece id tags the message."""
    rnd: list[tuple[int, WeightTransfer, tuple[int, int, int, int]]] = []
    size = 0
    piece_id = 0
    order = {name: i for i, name in enumerate(specs)}  # one parameter's transfers together (fallback lifetimes)
    isolate = _may_fall_back(plan, specs)
    for t in sorted((t for t in plan.transfers if not t.is_local), key=lambda t: (order[t.name], t.task_id)):
        spec = specs[t.name]
        dim = spec.dim
        outer, inner = math.prod(spec.shape[:dim]), math.prod(spec.shape[dim + 1 :])
        esize = elem[t.name]
        if outer == 1:
            step = max(1, chunk_bytes // max(1, inner * esize))
            pieces = [(0, 1, a, min(t.length, a + step)) for a in range(0, t.length, step)]
            row = inner * esize
        else:
            step = max(1, chunk_bytes // max(1, t.length * inner * esize))
            pieces = [(o, min(outer, o + step), 0, t.length) for o in range(0, outer, step)]
            row = t.length * inner * esize
        for piece in pieces:
            nbytes = (piece[1] - piece[0]) * (piece[3] - piece[2]) * row if outer == 1 else (piece[1] - piece[0]) * row
            if rnd and (size + nbytes > chunk_bytes or (rnd[-1][1].name != t.name
                                                         and (t.name in isolate or rnd[-1][1].name in isolate))):
                yield rnd
                rnd, size = [], 0
            rnd.append((piece_id, t, piece))
            size += nbytes
            piece_id += 1
    if rnd:
        yield rnd


def _may_fall_back(plan: WeightPlan, specs: dict) -> set[str]:
    """Parameters for which some device's part of the plan is neither a compaction nor an expansion (decided from the
    plan alone, so every device agrees; a device may still fall back for local reasons: too small a storage, then it
    holds at most the parameters sharing its rounds, up to a chunk of transfers)."""
    parts: dict[tuple[str, int], list[WeightTransfer]] = {}
    for t in plan.transfers:
        parts.setdefault((t.name, t.src_device), []).append(t)
        if not t.is_local:
            parts.setdefault((t.name, t.dst_device), []).append(t)
    out = set()
    for (name, device), ts in parts.items():
        spec = specs[name]
        keeps = [t for t in ts if t.is_local]
        sends = [t for t in ts if not t.is_local and t.src_device == device]
        if len(keeps) == len(ts):
            continue  # a compaction or nothing: no transfers
        old_w = spec.local_shape(plan.src.position(device)[1], plan.src.tp_size)[spec.dim]
        new_w = spec.local_shape(plan.dst.position(device)[1], plan.dst.tp_size)[spec.dim] \
            if device in plan.dst.devices else 0
        by_src = sorted(keeps, key=lambda t: t.src_offset)
        if new_w < old_w or any(t.dst_offset < t.src_offset for t in keeps) \
                or by_src != sorted(keeps, key=lambda t: t.dst_offset) \
                or not all(any(k.src_offset <= t.src_offset and t.src_offset + t.length <= k.src_offset + k.length
                               for k in keeps) for t in sends):
            out.add(name)
    return out


def _kept_offset(keeps: list[WeightTransfer], t: WeightTransfer) -> int:
    """Where old local slice [t.src_offset, +t.length) sits after an in-place expansion."""
    for k in keeps:
        if k.src_offset <= t.src_offset and t.src_offset + t.length <= k.src_offset + k.length:
            return t.src_offset - k.src_offset + k.dst_offset
    raise AssertionError(f"{t.name}: sent slice {t.src_offset}+{t.length} is in no kept slice")


def _can_expand(old: torch.Tensor, dim: int, keeps: list[WeightTransfer], sends: list[WeightTransfer],
                new_shape: tuple[int, ...]) -> bool:
    """In place is safe when the shard grows (or stays), every kept slice moves towards the back, in the same order
    as it was stored, and everything sent is also kept (sends then read it at its new offset)."""
    if not old.is_contiguous() or new_shape[dim] < old.shape[dim]:
        return False
    by_src = sorted(keeps, key=lambda t: t.src_offset)
    if any(t.dst_offset < t.src_offset for t in keeps) or by_src != sorted(keeps, key=lambda t: t.dst_offset):
        return False
    return all(any(k.src_offset <= t.src_offset and t.src_offset + t.length <= k.src_offset + k.length
                   for k in keeps) for t in sends)


def _has_room(old: torch.Tensor, new_shape: tuple[int, ...], may_resize: bool) -> bool:
    """The storage holds the new shard at the tensor's offset, or it may be (and is) resized to."""
    storage = old.untyped_storage()
    need = (old.storage_offset() + math.prod(new_shape)) * old.element_size()
    if storage.nbytes() >= need:
        return True
    if not may_resize or not storage.resizable():
        return False
    storage.resize_(need)  # reallocates: old and new of this one parameter alive for the copy
    return True


def _expand_in_place(t: torch.Tensor, dim: int, keeps: list[WeightTransfer], new_shape: tuple[int, ...],
                     scratch_elems: int) -> torch.Tensor:
    # The mirror of _compact_in_place: view as [outer, width, inner], width growing from w_old to w_new. New row i
    # starts at i*w_new*inner >= i*w_old*inner, so rows are processed back to front; a block of rows [j, i) is
    # copied at once when its writes start after its reads end (j*w_new >= i*w_old).
    outer, inner = math.prod(t.shape[:dim]), math.prod(t.shape[dim + 1 :])
    w_old, w_new = t.shape[dim], new_shape[dim]
    storage = t.untyped_storage()
    flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(),
                                                               (outer * w_new * inner,))
    pieces = sorted(keeps, key=lambda k: k.src_offset, reverse=True)
    if not (w_new == w_old and all(k.src_offset == k.dst_offset for k in pieces)):
        i = outer
        while i > 0:
            j = -(-i * w_old // w_new)  # ceil
            if j < i:
                src = flat[j * w_old * inner : i * w_old * inner].view(i - j, w_old, inner)
                dst = flat[j * w_new * inner : i * w_new * inner].view(i - j, w_new, inner)
                for k in pieces:
                    dst[:, k.dst_offset : k.dst_offset + k.length].copy_(
                        src[:, k.src_offset : k.src_offset + k.length])
                i = j
            else:
                row = i - 1
                for k in pieces:
                    _memmove_back(flat, (row * w_old + k.src_offset) * inner, (row * w_new + k.dst_offset) * inner,
                                  k.length * inner, scratch_elems)
                i = row
    t.set_(storage, t.storage_offset(), new_shape, _contiguous_strides(new_shape))
    return t


def _memmove_back(flat: torch.Tensor, src: int, dst: int, n: int, scratch_elems: int) -> None:
    """Copy flat[src:src+n] to flat[dst:dst+n] for dst >= src, correct when the ranges overlap: from the end, in
    pieces that never overlap a source not yet read (`gap` elements, or `scratch_elems` through a temporary)."""
    gap = dst - src
    assert gap >= 0
    if gap == 0 or n == 0:
        return
    if gap >= n:
        flat[dst : dst + n].copy_(flat[src : src + n])
        return
    step = gap if n // gap <= _MAX_CHUNKS or gap >= scratch_elems else scratch_elems
    end = n
    while end > 0:
        c = min(step, end)
        piece = flat[src + end - c : src + end]
        flat[dst + end - c : dst + end].copy_(piece if step == gap else piece.clone())
        end -= c


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
