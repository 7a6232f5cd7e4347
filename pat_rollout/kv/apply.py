"""Execute one device's part of a KV hand-off plan: export, exchange and reassemble per-request KV.

KV tensors are laid out [num_layers, 2 (K, V), num_tokens, heads, head_dim]. The exchange runs in rounds of at most
`chunk_bytes` (the same schedule on every device, from the whole plan): each transfer is split by tokens into pieces
of at most a chunk, and all pieces one device sends another in a round are packed into one flat message, tagged with
their first piece's id, so the message count grows with the bytes over the chunk size, not with requests or layers.
Scratch memory per device is about two chunks (a round's packed sends and receives, plus one exported piece); the
assembled result (`device`, host memory for the SGLang pool) holds exactly the KV this device receives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pat_rollout.comm.transport import Transport
from pat_rollout.kv.plan import KVPlan, KVTransfer

# export_fn(request_id, (head_lo, head_hi), (token_lo, token_hi)) -> [L, 2, token_hi - token_lo, heads, head_dim]
ExportFn = Callable[[str, tuple[int, int], tuple[int, int]], torch.Tensor]

DEFAULT_CHUNK_BYTES = 64 << 20

Piece = tuple[int, KVTransfer, int, int]  # (piece id, transfer, token lo, token hi)


def kv_rounds(transfers: Sequence[KVTransfer], token_bytes: Callable[[KVTransfer], int],
              chunk_bytes: int) -> list[list[Piece]]:
    """Every non-local transfer in task_id order, split by tokens into pieces of at most `chunk_bytes` (one token at
    least), grouped into rounds of at most `chunk_bytes` (one piece at least). Deterministic: every device computes
    the same rounds from the same plan."""
    rounds: list[list[Piece]] = []
    rnd: list[Piece] = []
    size = piece_id = 0
    for t in sorted((t for t in transfers if not t.is_local), key=lambda t: t.task_id):
        per_token = max(1, token_bytes(t))
        step = max(1, chunk_bytes // per_token)
        for lo in range(0, t.num_tokens, step):
            hi = min(t.num_tokens, lo + step)
            nbytes = (hi - lo) * per_token
            if rnd and size + nbytes > chunk_bytes:
                rounds.append(rnd)
                rnd, size = [], 0
            rnd.append((piece_id, t, lo, hi))
            size += nbytes
            piece_id += 1
    if rnd:
        rounds.append(rnd)
    return rounds


def gather_kv(transfers: KVPlan | Sequence[KVTransfer], my_device: int, export_fn: ExportFn, transport: Transport, *,
              num_layers: int, head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu",
              chunk_bytes: int = DEFAULT_CHUNK_BYTES, pin_memory: bool = False) -> dict[str, torch.Tensor]:
    """Send this device's exported pieces and assemble the KV it needs: request_id -> [L, 2, T, h, d] on `device`
    (pinned host memory with `pin_memory`).

    `transfers` is the KVPlan or all its transfers: every device must pass the same, since the rounds are computed
    from them (a device skips the pieces it has no part in). `export_fn(request_id, (lo, hi), (t0, t1))` returns
    the KV of global heads [lo, hi) and tokens [t0, t1) of a request this device held in the old layout. The returned
    tensor covers the contiguous head range this device needs for each request it receives, in head order.
    `num_layers`, `head_dim` and `dtype` size the receive buffers (a device may receive KV of a request it never
    held). Every device of the hand-off must call this concurrently, with the same `chunk_bytes`.
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes={chunk_bytes} must be >= 1")
    if isinstance(transfers, KVPlan):
        transfers = transfers.transfers
    transfers = tuple(transfers)
    elem = torch.empty((), dtype=dtype).element_size()
    ranges: dict[str, list[KVTransfer]] = {}
    for t in transfers:
        if t.dst_device == my_device:
            ranges.setdefault(t.request_id, []).append(t)
    out: dict[str, torch.Tensor] = {}
    head_lo: dict[str, int] = {}
    for request_id, ts in ranges.items():
        lo, hi = min(t.kv_heads[0] for t in ts), max(t.kv_heads[1] for t in ts)
        if sum(t.num_heads for t in ts) != hi - lo:
            raise RuntimeError(f"device {my_device}: request {request_id} receives heads "
                               f"{[t.kv_heads for t in ts]} that do not tile [{lo}, {hi}) once")
        head_lo[request_id] = lo
        out[request_id] = torch.empty((num_layers, 2, ts[0].num_tokens, hi - lo, head_dim), dtype=dtype,
                                      device=device, pin_memory=pin_memory)

    def slot(t: KVTransfer, t0: int, t1: int) -> torch.Tensor:
        lo = t.kv_heads[0] - head_lo[t.request_id]
        return out[t.request_id][:, :, t0:t1, lo : lo + t.num_heads]

    def piece_numel(t: KVTransfer, t0: int, t1: int) -> int:
        return num_layers * 2 * (t1 - t0) * t.num_heads * head_dim

    token_bytes = lambda t: num_layers * 2 * t.num_heads * head_dim * elem  # noqa: E731
    step = max(1, chunk_bytes // max(1, max((token_bytes(t) for t in transfers), default=1)))
    for t in transfers:  # local copies: piece by piece straight into place
        if t.is_local and t.dst_device == my_device:
            for t0 in range(0, t.num_tokens, step):
                t1 = min(t.num_tokens, t0 + step)
                slot(t, t0, t1).copy_(_export(export_fn, t, t0, t1, num_layers, head_dim))
    for rnd in kv_rounds(transfers, token_bytes, chunk_bytes):
        _run_round(rnd, my_device, export_fn, transport, slot, piece_numel, num_layers, head_dim, dtype, device)
    return out


def _run_round(rnd: list[Piece], me: int, export_fn: ExportFn, transport: Transport, slot, piece_numel,
               num_layers: int, head_dim: int, dtype: torch.dtype, device) -> None:
    """One round: one packed message per peer each way; its buffers are freed when this returns."""
    sends: dict[int, list[Piece]] = {}
    recvs: dict[int, list[Piece]] = {}
    for p in rnd:
        t = p[1]
        if t.src_device == me:
            sends.setdefault(t.dst_device, []).append(p)
        elif t.dst_device == me:
            recvs.setdefault(t.src_device, []).append(p)
    for peer, pieces in sorted(sends.items()):
        packed = None
        off = 0
        total = sum(piece_numel(t, t0, t1) for _, t, t0, t1 in pieces)
        for _, t, t0, t1 in pieces:
            kv = _export(export_fn, t, t0, t1, num_layers, head_dim)
            if packed is None:  # on the exporting device: the transport stages it if it must
                packed = torch.empty(total, dtype=dtype, device=kv.device)
            n = kv.numel()
            packed[off : off + n].view(kv.shape).copy_(kv)
            off += n
        transport.submit_send(packed, peer, pieces[0][0])
    buffers: list[tuple[torch.Tensor, list[Piece]]] = []
    for peer, pieces in sorted(recvs.items()):
        buf = torch.empty(sum(piece_numel(t, t0, t1) for _, t, t0, t1 in pieces), dtype=dtype, device=device)
        transport.submit_recv(buf, peer, pieces[0][0])
        buffers.append((buf, pieces))
    transport.run()
    for buf, pieces in buffers:
        off = 0
        for _, t, t0, t1 in pieces:
            n = piece_numel(t, t0, t1)
            slot(t, t0, t1).copy_(buf[off : off + n].view(num_layers, 2, t1 - t0, t.num_heads, head_dim))
            off += n


def _export(export_fn: ExportFn, t: KVTransfer, t0: int, t1: int, num_layers: int, head_dim: int) -> torch.Tensor:
    kv = export_fn(t.request_id, t.kv_heads, (t0, t1))
    expected = (num_layers, 2, t1 - t0, t.num_heads, head_dim)
    if tuple(kv.shape) != expected:
        raise RuntimeError(f"export_fn({t.request_id!r}, {t.kv_heads}, {(t0, t1)}) returned shape {tuple(kv.shape)}, "
                           f"task_id={t.task_id} expects {expected}")
    return kv
