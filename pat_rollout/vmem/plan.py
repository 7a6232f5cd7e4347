"""The reclaiming plan: which granules of weight storage a layout lends to the KV cache, where they map, and the
ordered steps of a switch. Pure stdlib (addresses are ints, sizes bytes).

The model: every weight storage is a granule-aligned address range mapped with one physical page (a granule-sized
handle) per granule; the in-place reshard keeps a layout's shard at the storage's start, so at TP=t the bytes past
`kept[t]` are unused. Its *tail* at t is [align_up(start + kept[t]), align_down(start + nbytes)): rounded inward to
whole granules (a tail shorter than a granule, or one that ends in the granule the shard ends in, lends nothing).
Each KV region (one per layer storage: SGLang allocates K and V of a layer together) is a reserved address range
whose first `base_bytes` are mapped at start-up; the rest of its reservation takes lent pages.

Order: pages are lent in a fixed global order (the pages a TP2 tail adds, then those TP4's adds, ..., within one TP
by storage then address), so the pages lent at a larger TP are a superset of those at a smaller one and a switch
moves only the difference. Page i of that order maps at region i % N, offset base_bytes + (i // N) * granule: every
region grows by the same number of granules (every layer has the same slots), so a layout lends
N * floor(pages / N) pages (capped by the reservations); the rest stay mapped in their weight tails, unused.

A page moves (unmap at one address, then map the same physical handle at the other): no physical memory is
allocated or freed by a switch and a handle is never mapped twice, so the physical bytes stay the budget at every
step. Grow: pages lent in order, each unmapped from its weight tail then mapped at its KV slot. Shrink: pages
taken back in reverse order, each unmapped from the KV range then mapped back at its weight address; the caller
must have emptied the KV bytes being given back (`ReclaimPlan.check_shrink`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

CUDA_GRANULE = 2 << 20  # cuMemGetAllocationGranularity's minimum on current NVIDIA GPUs (2 MiB)


class ReclaimError(ValueError):
    """A plan or a step that would break the mapping's invariants (nothing was changed)."""


def align_up(x: int, granule: int) -> int:
    return -(-x // granule) * granule


def align_down(x: int, granule: int) -> int:
    return x // granule * granule


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightStorage:
    """One parameter's storage: `start` (granule-aligned address), `nbytes` (its size; the mapping covers
    align_up(nbytes)), `kept[tp]`: bytes its shard occupies at the storage's start in a TP=tp layout."""

    name: str
    start: int
    nbytes: int
    kept: Mapping[int, int]


@dataclass(frozen=True, kw_only=True, slots=True)
class KvRegion:
    """One KV storage: `start` (granule-aligned), `base_bytes` mapped at start-up (a multiple of the granule),
    `reserved_bytes` of address range (>= base_bytes) that lent pages extend it into."""

    start: int
    base_bytes: int
    reserved_bytes: int


@dataclass(frozen=True, slots=True)
class Step:
    """One mapper call: "unmap" the granule at `va`, or "map" the physical page `page` (named by its home
    address in the weights) at `va`."""

    op: str
    va: int
    page: int


@dataclass(frozen=True, kw_only=True)
class ReclaimPlan:
    """The plan for one device (build with `ReclaimPlan.build`)."""

    granule: int
    weights: tuple[WeightStorage, ...]
    kv: tuple[KvRegion, ...]
    tps: tuple[int, ...]
    order: tuple[int, ...]  # home addresses of the lendable pages, in lending order
    lendable: Mapping[int, int] = field(default_factory=dict)  # tp -> pages of `order` whose tail is free at tp

    @classmethod
    def build(cls, *, weights: Sequence[WeightStorage], kv: Sequence[KvRegion], tps: Sequence[int],
              granule: int = CUDA_GRANULE) -> ReclaimPlan:
        """ReclaimError when an address or size is not granule-aligned where it must be, ranges overlap, a storage
        lacks `kept` for a TP, a shard outgrows its storage, or the tails are not nested (a larger TP must keep no
        more of any storage than a smaller one)."""
        if granule < 1 or not kv or not tps:
            raise ReclaimError(f"granule={granule} must be >= 1 and kv ({len(kv)} regions), tps ({tps}) non-empty")
        tps = tuple(sorted(set(tps)))
        spans = []
        for w in weights:
            if w.start % granule or w.nbytes < 0:
                raise ReclaimError(f"weight {w.name}: start {w.start:#x} is not {granule}-aligned or nbytes "
                                   f"{w.nbytes} < 0")
            missing = [t for t in tps if t not in w.kept]
            if missing:
                raise ReclaimError(f"weight {w.name}: no kept bytes for tp {missing}")
            for t in tps:
                if not 0 <= w.kept[t] <= w.nbytes:
                    raise ReclaimError(f"weight {w.name}: kept[{t}]={w.kept[t]} outside its storage of {w.nbytes} B")
            spans.append((w.start, w.start + align_up(w.nbytes, granule), f"weight {w.name}"))
        for i, r in enumerate(kv):
            if r.start % granule or r.base_bytes % granule or r.reserved_bytes % granule:
                raise ReclaimError(f"KV region {i}: start {r.start:#x}, base {r.base_bytes} and reserved "
                                   f"{r.reserved_bytes} bytes must be multiples of the granule {granule}")
            if r.reserved_bytes < r.base_bytes:
                raise ReclaimError(f"KV region {i}: reserved {r.reserved_bytes} B < base {r.base_bytes} B")
            spans.append((r.start, r.start + r.reserved_bytes, f"KV region {i}"))
        spans.sort()
        for (a0, a1, an), (b0, _, bn) in zip(spans, spans[1:]):
            if b0 < a1:
                raise ReclaimError(f"{an} [{a0:#x}, {a1:#x}) overlaps {bn} at {b0:#x}")
        order: list[int] = []
        lendable: dict[int, int] = {}
        prev: dict[str, range] = {w.name: range(0) for w in weights}
        for t in tps:
            for w in weights:
                tail = _tail(w, t, granule)
                if prev[w.name] and (tail.start > prev[w.name].start or tail.stop < prev[w.name].stop):
                    raise ReclaimError(f"weight {w.name}: tail at tp {t} {_fmt(tail)} does not contain the smaller "
                                       f"layout's {_fmt(prev[w.name])}: kept bytes must not grow with the TP")
                order.extend(va for va in tail if va not in prev[w.name])
                prev[w.name] = tail
            lendable[t] = len(order)
        return cls(granule=granule, weights=tuple(weights), kv=tuple(kv), tps=tps, order=tuple(order),
                   lendable=lendable)

    def _check_tp(self, tp: int) -> None:
        if tp not in self.lendable:
            raise ReclaimError(f"tp={tp} is not one of the plan's layouts {list(self.tps)}")

    def ext_pages(self, tp: int) -> int:
        """Lent pages each KV region maps past its base at TP=tp."""
        self._check_tp(tp)
        cap = min((r.reserved_bytes - r.base_bytes) // self.granule for r in self.kv)
        return min(self.lendable[tp] // len(self.kv), cap)

    def lent_pages(self, tp: int) -> int:
        return self.ext_pages(tp) * len(self.kv)

    def reclaimed_bytes(self, tp: int) -> int:
        """Bytes of weight storage mapped into the KV regions at TP=tp."""
        return self.lent_pages(tp) * self.granule

    def freed_bytes(self, tp: int) -> int:
        """Bytes of weight storage a TP=tp layout no longer uses, before any rounding (what a stock engine at tp
        would not have allocated, relative to the smallest layout of the plan)."""
        self._check_tp(tp)
        base = self.tps[0]
        return sum(w.kept[base] - w.kept[tp] for w in self.weights)

    def loss_bytes(self, tp: int) -> int:
        """freed - reclaimed: what granule rounding (tails, equal regions, reservations) leaves unused."""
        return self.freed_bytes(tp) - self.reclaimed_bytes(tp)

    def kv_mapped_bytes(self, tp: int) -> list[int]:
        """Mapped bytes of each KV region at TP=tp (its base plus the pages lent to it)."""
        return [r.base_bytes + self.ext_pages(tp) * self.granule for r in self.kv]

    def kv_slot(self, i: int) -> int:
        """Address page i of the lending order maps at."""
        r = self.kv[i % len(self.kv)]
        return r.start + r.base_bytes + (i // len(self.kv)) * self.granule

    def weight_pages(self) -> list[int]:
        """Every page of weight storage (home addresses), in storage then address order."""
        return [va for w in self.weights for va in range(w.start, w.start + align_up(w.nbytes, self.granule),
                                                         self.granule)]

    def mapping(self, tp: int) -> dict[int, int]:
        """What a TP=tp layout maps: weight page address -> address it is mapped at (KV bases not included)."""
        lent = set(self.order[: self.lent_pages(tp)])
        out = {va: va for va in self.weight_pages() if va not in lent}
        out.update({self.order[i]: self.kv_slot(i) for i in range(self.lent_pages(tp))})
        return out

    def steps(self, src_tp: int, dst_tp: int) -> list[Step]:
        """The ordered mapper calls from a TP=src_tp layout to TP=dst_tp (each page unmapped before it is mapped
        again: a handle is never mapped twice and nothing is allocated)."""
        a, b = self.lent_pages(src_tp), self.lent_pages(dst_tp)
        out: list[Step] = []
        for i in range(a, b):  # grow: lend pages a..b-1
            out += [Step("unmap", self.order[i], self.order[i]), Step("map", self.kv_slot(i), self.order[i])]
        for i in reversed(range(b, a)):  # shrink: take back from the KV ranges' ends
            out += [Step("unmap", self.kv_slot(i), self.order[i]), Step("map", self.order[i], self.order[i])]
        return out

    def check_shrink(self, src_tp: int, dst_tp: int, kv_used_bytes: Sequence[int]) -> None:
        """ReclaimError unless every region's used extent (`kv_used_bytes[r]`: bytes from its start up to the last
        byte holding live KV) fits the destination's mapped extent: KV in pages a shrink unmaps must be handed off
        (migrated or recomputed) and freed first."""
        if len(kv_used_bytes) != len(self.kv):
            raise ReclaimError(f"kv_used_bytes has {len(kv_used_bytes)} entries for {len(self.kv)} KV regions")
        mapped = self.kv_mapped_bytes(dst_tp)
        over = [(i, u, m) for i, (u, m) in enumerate(zip(kv_used_bytes, mapped)) if u > m]
        if over and self.lent_pages(dst_tp) < self.lent_pages(src_tp):
            i, u, m = over[0]
            raise ReclaimError(f"shrink tp {src_tp} -> {dst_tp}: KV region {i} holds live KV up to byte {u} but keeps "
                               f"only {m} mapped ({len(over)} region(s) over): hand those requests off (migrate or "
                               f"recompute) and free their slots before the pages are given back")


def _tail(w: WeightStorage, tp: int, granule: int) -> range:
    lo, hi = align_up(w.start + w.kept[tp], granule), align_down(w.start + align_up(w.nbytes, granule), granule)
    return range(lo, max(lo, hi), granule)


def _fmt(r: range) -> str:
    return f"[{r.start:#x}, {r.stop:#x})"


def even_kept(nbytes: int, base_tp: int, tps: Sequence[int], *, sharded: bool = True) -> dict[int, int]:
    """kept bytes of a storage holding a base_tp shard of `nbytes`, sharded evenly at every TP of `tps` (each a
    multiple of base_tp), or replicated (`sharded=False`: kept whole)."""
    return {t: (nbytes * base_tp // t if sharded else nbytes) for t in tps}
