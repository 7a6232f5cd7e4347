"""Single-process simulation helpers: unique-valued full weights and threaded per-device execution."""

from __future__ import annotations

import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "layout"))

from pat_rollout.comm.transport import LoopbackMailbox, LoopbackTransport  # noqa: E402
from pat_rollout.layout import Layout, ShardSpec  # noqa: E402
from pat_rollout.reshard.apply import shard  # noqa: E402

T = TypeVar("T")


def full_weights(specs: dict[str, ShardSpec], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every element of every parameter has a distinct value (exact in float32: < 2**24 elements)."""
    out, base = {}, 0
    for name in sorted(specs):
        n = specs[name].numel()
        out[name] = (torch.arange(n, dtype=torch.float64) + base).to(dtype).reshape(specs[name].shape)
        base += n
    assert base < 2**24
    return out


def local_shards(full: dict[str, torch.Tensor], specs: dict[str, ShardSpec], layout: Layout,
                 device: int) -> dict[str, torch.Tensor]:
    _, rank = layout.position(device)
    return {n: shard(full[n], specs[n], rank, layout.tp_size) for n in specs}


def run_devices(devices: tuple[int, ...], fn: Callable[[int, LoopbackTransport], T]) -> dict[int, T]:
    """Run fn(device, transport) for every device concurrently, one thread each, sharing one mailbox."""
    mailbox = LoopbackMailbox(timeout_s=20.0)
    transports = {d: LoopbackTransport(mailbox, d) for d in devices}
    with ThreadPoolExecutor(max_workers=len(devices)) as pool:
        futures = {d: pool.submit(fn, d, transports[d]) for d in devices}
        results = {d: f.result() for d, f in futures.items()}
    assert mailbox.pending() == [], f"unconsumed messages {mailbox.pending()}"
    return results
