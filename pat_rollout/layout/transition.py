"""Transition plans between two rollout layouts: new groups and rank order, and weight slices to keep or move.

Pure: stdlib and pat_rollout only. All ranges are half-open [lo, hi) along a parameter's sharded dim;
"full" offsets index the unsharded tensor, "local" offsets index one rank's shard in storage order.

Rank order is what makes resharding lightweight. Growing TP by k merges k groups and gives the device
with old rank r in the j-th merged group new rank r*k + j: its new shard is a slice of the one it holds,
so nothing moves. Shrinking by k sends the device with old rank r to new group r % k at new rank r // k:
it already holds 1/k of what it needs and receives only the rest.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction

from pat_rollout.layout.layout import Layout
from pat_rollout.layout.shard import Interval, ShardSpec, shard_intervals


def plan_layout(src: Layout, dst_tp: int, base: Layout | None = None) -> Layout:
    """Groups and TP-rank order for moving `src` to a uniform TP size `dst_tp` on the same devices.

    With `base` (the pool's start layout) and dst_tp == base.tp_size the answer is `base` itself: the
    shrink rule below can land on the base groups in another replica or rank order (4 devices 1 -> 2 -> 4
    -> 1 gives [[0],[2],[1],[3]]), and weight updates, rollback and stage starts all need the base exactly.

    Grow by k (dst_tp = k * tp): merge consecutive runs of k groups; old rank r of the j-th group gets
    new rank r*k + j (zero bytes move). Shrink by k (tp = k * dst_tp): split each group; old rank r goes
    to sub-group r % k at rank r // k (minimal bytes move). Other ratios (e.g. 2 -> 3): greedy; for each
    new group in turn and each new rank, take the free device whose old shard overlaps the new rank's
    shard most (overlap measured on an evenly split dim, exact for heads and MLP), breaking ties towards
    the old replica already most used by the group, then the lowest device id. Raises ValueError if
    `dst_tp` does not divide the number of devices.
    """
    num_devices, tp = len(src.devices), src.tp_size
    if dst_tp <= 0 or num_devices % dst_tp:
        raise ValueError(f"dst_tp={dst_tp} must be positive and divide num_devices={num_devices} (src {src})")
    if base is not None and dst_tp == base.tp_size:
        if base.devices != src.devices:
            raise ValueError(f"base {base} covers devices {base.devices}, src {src} covers {src.devices}")
        return base
    if dst_tp == tp:
        return src
    if dst_tp % tp == 0:
        k = dst_tp // tp
        groups = []
        for first in range(0, src.num_replicas, k):
            merged = src.groups[first : first + k]
            rank_to_device = {r * k + j: g[r] for j, g in enumerate(merged) for r in range(tp)}
            groups.append(tuple(rank_to_device[i] for i in range(dst_tp)))
        return Layout(tuple(groups))
    if tp % dst_tp == 0:
        k = tp // dst_tp
        return Layout(tuple(tuple(g[s + k * i] for i in range(dst_tp)) for g in src.groups for s in range(k)))
    return _plan_layout_greedy(src, dst_tp)


def _overlap(r: int, tp: int, new_r: int, dst_tp: int) -> Fraction:
    lo = max(Fraction(r, tp), Fraction(new_r, dst_tp))
    hi = min(Fraction(r + 1, tp), Fraction(new_r + 1, dst_tp))
    return max(hi - lo, Fraction(0))


def _plan_layout_greedy(src: Layout, dst_tp: int) -> Layout:
    free = set(src.devices)
    groups: list[tuple[int, ...]] = []
    for _ in range(len(free) // dst_tp):
        group: list[int] = []
        for new_r in range(dst_tp):
            replica_use: dict[int, int] = {}
            for d in group:
                replica_use[src.position(d)[0]] = replica_use.get(src.position(d)[0], 0) + 1

            def score(d: int) -> tuple[Fraction, int, int]:
                replica, r = src.position(d)
                return (_overlap(r, src.tp_size, new_r, dst_tp), replica_use.get(replica, 0), -d)

            best = max(free, key=score)
            free.remove(best)
            group.append(best)
        groups.append(tuple(group))
    return Layout(tuple(groups))


@dataclass(frozen=True, slots=True)
class WeightTransfer:
    """One slice [lo, hi) (full offsets) of parameter `name` that `dst_device` needs after the transition.

    src_device == dst_device means a local keep: copy from local offset `src_offset` of the old shard to
    `dst_offset` of the new one. Otherwise `src_device` sends and `dst_device` receives it. `task_id` is
    the position in `WeightPlan.transfers` and tags the message.
    """

    task_id: int
    name: str
    src_device: int
    dst_device: int
    lo: int
    hi: int
    src_offset: int
    dst_offset: int

    @property
    def length(self) -> int:
        return self.hi - self.lo

    @property
    def is_local(self) -> bool:
        return self.src_device == self.dst_device


@dataclass(frozen=True, slots=True)
class WeightPlan:
    """Every slice each device keeps or receives, ordered by (dst device, parameter, dst offset)."""

    src: Layout
    dst: Layout
    specs: tuple[ShardSpec, ...]
    transfers: tuple[WeightTransfer, ...]

    def transfers_for(self, device: int) -> tuple[WeightTransfer, ...]:
        """Slices `device` keeps, sends or receives, in task_id order."""
        return tuple(t for t in self.transfers if device in (t.src_device, t.dst_device))

    def keeps_for(self, device: int) -> tuple[WeightTransfer, ...]:
        return tuple(t for t in self.transfers if t.is_local and t.dst_device == device)

    def sends_for(self, device: int) -> tuple[WeightTransfer, ...]:
        return tuple(t for t in self.transfers if not t.is_local and t.src_device == device)

    def recvs_for(self, device: int) -> tuple[WeightTransfer, ...]:
        return tuple(t for t in self.transfers if not t.is_local and t.dst_device == device)

    def spec(self, name: str) -> ShardSpec:
        for s in self.specs:
            if s.name == name:
                return s
        raise KeyError(name)


def check_specs_tp(specs: Mapping[str, ShardSpec], tp_size: int) -> None:
    """Raise ValueError naming the parameter unless every partition can be sharded over `tp_size`
    (same rule as ModelSpec.check_tp: split when tp divides the units, replicate when units divide tp)."""
    for spec in specs.values():
        for part in spec.partitions:
            if part.num_units % tp_size and tp_size % part.num_units:
                raise ValueError(
                    f"tp_size={tp_size} cannot shard {spec.name}: partition num_units={part.num_units} "
                    f"(unit_size={part.unit_size}) must be divisible by tp_size or divide it"
                )


def _row_numel(spec: ShardSpec) -> int:
    """Elements per unit of the sharded dim (product of the other dims)."""
    n = 1
    for i, s in enumerate(spec.shape):
        if i != spec.dim:
            n *= s
    return n


def _local_map(intervals: tuple[Interval, ...]) -> list[tuple[int, int, int]]:
    """(full_lo, full_hi, local_lo) for each held interval."""
    out, off = [], 0
    for lo, hi in intervals:
        out.append((lo, hi, off))
        off += hi - lo
    return out


def plan_weights(src: Layout, dst: Layout, specs: Mapping[str, ShardSpec]) -> WeightPlan:
    """Deterministic plan of which slice of every parameter each device keeps and receives.

    For every dst device (ascending id) and parameter (sorted by name), each interval of its new shard
    is cut at the boundaries of what the device already holds: held pieces become local keeps, the rest
    is received from a holder, preferring devices of the receiver's own old replica, then the holder with
    the fewest bytes assigned so far, then the lowest id. Only bytes a device does not hold move, so the
    plan moves the minimum for the given layouts. Raises ValueError if the layouts cover different
    devices or a TP size cannot shard `specs`. Replicated parameters (dim None) get no entries: every
    device keeps them as they are.
    """
    if src.devices != dst.devices:
        raise ValueError(f"layouts cover different devices: src {src} devices {src.devices}, dst {dst} {dst.devices}")
    check_specs_tp(specs, src.tp_size)
    check_specs_tp(specs, dst.tp_size)
    ordered = tuple(specs[n] for n in sorted(specs) if specs[n].dim is not None)
    load: dict[int, int] = dict.fromkeys(src.devices, 0)
    out: list[WeightTransfer] = []
    for device in dst.devices:
        old_replica, old_rank = src.position(device)
        _, new_rank = dst.position(device)
        for spec in ordered:
            held = _local_map(shard_intervals(spec, old_rank, src.tp_size))
            holders = _holders(src, spec)
            for lo, hi, dst_off in _local_map(shard_intervals(spec, new_rank, dst.tp_size)):
                for piece in _cover(lo, hi, held, holders, device, old_replica, src, load, _row_numel(spec)):
                    src_dev, plo, phi, src_off = piece
                    out.append(WeightTransfer(len(out), spec.name, src_dev, device, plo, phi, src_off,
                                              dst_off + plo - lo))
    return WeightPlan(src, dst, ordered, tuple(out))


def _holders(src: Layout, spec: ShardSpec) -> list[tuple[int, int, int, int, int]]:
    """(full_lo, full_hi, local_lo, device, replica) of every interval held by any src device."""
    out = []
    for replica, group in enumerate(src.groups):
        for rank, device in enumerate(group):
            for lo, hi, off in _local_map(shard_intervals(spec, rank, src.tp_size)):
                out.append((lo, hi, off, device, replica))
    return out


def _cover(lo: int, hi: int, held: list[tuple[int, int, int]], holders: list[tuple[int, int, int, int, int]],
           device: int, replica: int, src: Layout, load: dict[int, int],
           row_numel: int) -> list[tuple[int, int, int, int]]:
    """Pieces (src_device, lo, hi, src_local_offset) covering [lo, hi) exactly once, local pieces first-class."""
    cuts = {lo, hi}
    for h_lo, h_hi, *_ in holders:
        if lo < h_lo < hi:
            cuts.add(h_lo)
        if lo < h_hi < hi:
            cuts.add(h_hi)
    bounds = sorted(cuts)
    pieces: list[tuple[int, int, int, int]] = []
    for a, b in zip(bounds, bounds[1:]):
        own = [(h_lo, off) for h_lo, h_hi, off in held if h_lo <= a and b <= h_hi]
        if own:
            h_lo, off = own[0]
            choice = (device, a, b, off + a - h_lo)
        else:
            cands = [(h_lo, off, d, r) for h_lo, h_hi, off, d, r in holders if h_lo <= a and b <= h_hi]
            assert cands, f"no holder for [{a}, {b}) in {src}"
            h_lo, off, d, _ = min(cands, key=lambda c: (c[3] != replica, load[c[2]], c[2]))
            load[d] += (b - a) * row_numel
            choice = (d, a, b, off + a - h_lo)
        prev = pieces[-1] if pieces else None
        if prev and prev[0] == choice[0] and prev[2] == a and prev[3] + (prev[2] - prev[1]) == choice[3]:
            pieces[-1] = (prev[0], prev[1], b, prev[3])
        else:
            pieces.append(choice)
    return pieces


def bytes_moved(plan: WeightPlan, dtype_bytes: int) -> int:
    """Bytes that cross devices when executing `plan` (local keeps are free)."""
    sizes = {s.name: _row_numel(s) for s in plan.specs}
    return sum(t.length * sizes[t.name] for t in plan.transfers if not t.is_local) * dtype_bytes


def spec_hash(specs: Mapping[str, ShardSpec]) -> str:
    """Stable digest of a spec table (order-independent), for plan cache keys."""
    text = repr(tuple(specs[n] for n in sorted(specs)))
    return hashlib.sha1(text.encode()).hexdigest()


class PlanCache:
    """LRU cache of weight plans keyed by (src, dst, spec_hash(specs)); plans are immutable and shareable."""

    def __init__(self, max_entries: int = 64) -> None:
        self.max_entries = max_entries
        self._plans: OrderedDict[tuple[Layout, Layout, str], WeightPlan] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, src: Layout, dst: Layout, specs: Mapping[str, ShardSpec]) -> WeightPlan:
        key = (src, dst, spec_hash(specs))
        plan = self._plans.get(key)
        if plan is not None:
            self.hits += 1
            self._plans.move_to_end(key)
            return plan
        self.misses += 1
        plan = plan_weights(src, dst, specs)
        self._plans[key] = plan
        if len(self._plans) > self.max_entries:
            self._plans.popitem(last=False)
        return plan
