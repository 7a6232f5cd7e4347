"""One device check of a plan's page moves, shared by the CPU test (FakeMapper with memory behind its handles) and
the GPU test (CudaMapper, torch tensors over the addresses): data in the kept head and the KV base stay, the pages
a grow lends arrive in the KV range with their bytes (the same physical pages, nothing allocated), a shrink over
live KV is refused, a shrink brings the KV range's bytes back under the weight addresses, and the device's free
memory moves only at start-up and at close. Pure stdlib."""

from __future__ import annotations

from collections.abc import Callable

from pat_rollout.vmem.mapper import Mapper, apply_switch, map_initial
from pat_rollout.vmem.plan import KvRegion, ReclaimError, ReclaimPlan, WeightStorage


def pattern(i: int, nbytes: int) -> bytes:
    """nbytes of a byte ramp starting at i (distinct per page)."""
    ramp = bytes((i + j) % 256 for j in range(256))
    return ramp * (nbytes // 256) + ramp[: nbytes % 256]


def page_move_check(mapper: Mapper, read: Callable[[int, int], bytes], write: Callable[[int, bytes], None],
                    free_bytes: Callable[[], int]) -> dict:
    """Runs the check; returns what it saw (the caller asserts): "free" (device free bytes before start-up, after
    start-up, after the grow, after the shrink, after close), "grow_kv" / "shrink_weights" (whether each moved page
    holds the bytes it should), "head_kept", "kv_base_kept", "refused" (the over-live-KV shrink's message) and the
    "plan"."""
    g = mapper.granule
    wva, kva = mapper.reserve(4 * g), mapper.reserve(4 * g)
    plan = ReclaimPlan.build(weights=[WeightStorage(name="w", start=wva, nbytes=4 * g, kept={1: 4 * g, 2: 2 * g,
                                                                                             4: g})],
                             kv=[KvRegion(start=kva, base_bytes=g, reserved_bytes=4 * g)], tps=(1, 2, 4), granule=g)
    free = [free_bytes()]
    handles = map_initial(plan, mapper)
    free.append(free_bytes())
    for p in range(4):
        write(wva + p * g, pattern(p, g))
    write(kva, pattern(100, g))
    apply_switch(plan, mapper, handles, 1, 4, kv_used_bytes=[g])
    free.append(free_bytes())
    order = [(a - wva) // g for a in plan.order]  # weight pages in lending order: 2, 3 (TP2), then 1 (TP4)
    grow_kv = [read(plan.kv_slot(i), g) == pattern(p, g) for i, p in enumerate(order)]
    for i in range(len(order)):
        write(plan.kv_slot(i), pattern(200 + i, g))
    refused = ""
    try:
        apply_switch(plan, mapper, handles, 4, 1, kv_used_bytes=[2 * g])
    except ReclaimError as e:
        refused = str(e)
    apply_switch(plan, mapper, handles, 4, 1, kv_used_bytes=[g])
    free.append(free_bytes())
    shrink_weights = [read(wva + p * g, g) == pattern(200 + i, g) for i, p in enumerate(order)]
    out = dict(order=order, grow_kv=grow_kv, shrink_weights=shrink_weights, refused=refused,
               head_kept=read(wva, g) == pattern(0, g), kv_base_kept=read(kva, g) == pattern(100, g), plan=plan)
    close = getattr(mapper, "close", None)
    if close is not None:
        close()
    free.append(free_bytes())
    out["free"] = free
    return out
