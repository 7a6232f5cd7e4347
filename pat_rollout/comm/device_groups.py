"""Device communicators made eagerly at start-up, and what they cost in device memory.

torch's NCCL process groups create their communicator on the first collective unless the default group was bound to
a device (`init_process_group(device_id=...)`, which SGLang does not pass). A pool that switches layouts would then
create one more NCCL communicator (about 0.5-0.7 GB, a 0.5-2 s stall: NVIDIA/nccl#964) at the first eager
all-gather in each new layout, out of the headroom left after the KV pool took the rest. `warm_up` runs one tiny
all-reduce per group at start-up instead, before the KV pool is sized, so the memory comes out of the KV budget and
no first-entry stall is left; `measured` says how many device bytes the communicators took.

Collective: every rank calls `warm_up` with its groups in the same order (for each layout, each rank is in exactly
one group, so the members of a group reach its all-reduce together).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch


def warm_up(groups: Iterable[Any], device: torch.device | str) -> int:
    """One 1-element all-reduce on each NCCL group in `groups` (torch ProcessGroups this rank is a member of): the
    communicator exists afterwards. Other backends are eager already (gloo) and skipped. Returns how many groups
    were warmed."""
    import torch.distributed as dist

    n = 0
    for pg in groups:
        if pg is None or str(dist.get_backend(pg)) != "nccl":
            continue
        dist.all_reduce(torch.zeros(1, device=device), group=pg)
        n += 1
    if n:
        torch.cuda.synchronize(device)
    return n


@contextlib.contextmanager
def measured(device: torch.device | str | None, out: dict[str, Any]) -> Iterator[None]:
    """Device bytes taken while the block ran (free memory before - after, the whole device: NCCL's and custom
    all-reduce's buffers are not torch allocations), into `out["bytes"]`; 0 without CUDA."""
    on_cuda = device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available()
    if on_cuda:
        torch.cuda.synchronize(device)
    before = torch.cuda.mem_get_info(device)[0] if on_cuda else 0
    try:
        yield
    finally:
        if on_cuda:
            torch.cuda.synchronize(device)
        out["bytes"] = max(0, before - torch.cuda.mem_get_info(device)[0]) if on_cuda else 0
