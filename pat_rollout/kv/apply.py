"""Execute one device's part of a KV hand-off plan: export, exchange and reassemble per-request KV.

KV tensors are laid out [num_layers, 2 (K, V), num_tokens, heads, head_dim]. All pieces one device
sends another are packed into a single flat message per (src, dst) pair, tagged with the pair's
smallest task_id, so the message count does not grow with requests or layers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pat_rollout.comm.transport import Transport
from pat_rollout.kv.plan import KVPlan, KVTransfer

ExportFn = Callable[[str, tuple[int, int]], torch.Tensor]


def gather_kv(transfers: KVPlan | Sequence[KVTransfer], my_device: int, export_fn: ExportFn, transport: Transport, *,
              num_layers: int, head_dim: int, dtype: torch.dtype,
              device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Send this device's exported pieces and assemble the KV it needs: request_id -> [L, 2, T, h, d].

    `transfers` may be the KVPlan, all its transfers or `plan.transfers_for(my_device)`.
    `export_fn(request_id, (lo, hi))` returns the KV of global heads [lo, hi) of a request this device held
    in the old layout. The returned tensor covers the contiguous head range this device needs for each
    request it receives, in head order. `num_layers`, `head_dim` and `dtype` size the receive buffers (a
    device may receive KV of a request it never held). Every device of the hand-off must call this concurrently.
    """
    if isinstance(transfers, KVPlan):
        transfers = transfers.transfers
    mine = [t for t in transfers if my_device in (t.src_device, t.dst_device)]
    outgoing: dict[int, list[KVTransfer]] = {}
    incoming: dict[int, list[KVTransfer]] = {}
    ranges: dict[str, list[KVTransfer]] = {}
    for t in mine:
        if t.dst_device == my_device:
            ranges.setdefault(t.request_id, []).append(t)
        if not t.is_local:
            table = outgoing if t.src_device == my_device else incoming
            peer = t.dst_device if t.src_device == my_device else t.src_device
            table.setdefault(peer, []).append(t)
    out: dict[str, torch.Tensor] = {}
    head_lo: dict[str, int] = {}
    for request_id, ts in ranges.items():
        lo, hi = min(t.kv_heads[0] for t in ts), max(t.kv_heads[1] for t in ts)
        if sum(t.num_heads for t in ts) != hi - lo:
            raise RuntimeError(f"device {my_device}: request {request_id} receives heads "
                               f"{[t.kv_heads for t in ts]} that do not tile [{lo}, {hi}) once")
        head_lo[request_id] = lo
        out[request_id] = torch.empty((num_layers, 2, ts[0].num_tokens, hi - lo, head_dim), dtype=dtype, device=device)

    def slot(t: KVTransfer) -> torch.Tensor:
        lo = t.kv_heads[0] - head_lo[t.request_id]
        return out[t.request_id][:, :, :, lo : lo + t.num_heads]

    for peer, ts in sorted(outgoing.items()):
        packed = torch.cat([_export(export_fn, t, num_layers, head_dim).reshape(-1) for t in ts])
        transport.submit_send(packed.to(dtype), peer, ts[0].task_id)
    buffers: list[tuple[torch.Tensor, list[KVTransfer]]] = []
    for peer, ts in sorted(incoming.items()):
        numel = sum(num_layers * 2 * t.num_tokens * t.num_heads * head_dim for t in ts)
        buf = torch.empty(numel, dtype=dtype, device=device)
        transport.submit_recv(buf, peer, ts[0].task_id)
        buffers.append((buf, ts))
    for t in mine:
        if t.is_local:
            slot(t).copy_(_export(export_fn, t, num_layers, head_dim))
    transport.run()
    for buf, ts in buffers:
        off = 0
        for t in ts:
            n = num_layers * 2 * t.num_tokens * t.num_heads * head_dim
            slot(t).copy_(buf[off : off + n].view(num_layers, 2, t.num_tokens, t.num_heads, head_dim))
            off += n
    return out


def _export(export_fn: ExportFn, t: KVTransfer, num_layers: int, head_dim: int) -> torch.Tensor:
    kv = export_fn(t.request_id, t.kv_heads)
    expected = (num_layers, 2, t.num_tokens, t.num_heads, head_dim)
    if tuple(kv.shape) != expected:
        raise RuntimeError(f"export_fn({t.request_id!r}, {t.kv_heads}) returned shape {tuple(kv.shape)}, "
                           f"task_id={t.task_id} expects {expected}")
    return kv
