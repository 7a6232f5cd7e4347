"""KV room per layout inside an SglPool scheduler process.

SGLang allocates its KV storage once, for the base layout (token count from `mem_fraction_static`, heads per
rank of `initial_tp`). A switch keeps that storage (no allocation: the same bytes, the same addresses) and views
it again for the new per-rank head count, so a TPk replica holds k times the tokens of a TP1 replica
(`planner.capacity.tokens_in_room`, the one rule the planner and the simulator use), then sets every token limit
SGLang's scheduler admits against: the pool's and allocator's size (free list rebuilt), the model runner's and
scheduler's `max_total_num_tokens`, `max_req_len` / `max_req_input_len`, and the copies SGLang's scheduler
components keep. `max_prefill_tokens`, `chunked_prefill_size` and the new-token ratio are not capacities
(server-args caps and a ratio of the free room) and stay. The tokenizer manager keeps the base layout's
`max_req_input_len`, the smallest (the base is the smallest TP).

With `PatRolloutConfig.reclaim_weight_memory` (RECLAIM_ENV in the scheduler processes; docs/kv_reclaim.md) a
layout's room is the base room plus the weight bytes its shard no longer uses, as a `vmem.ReclaimPlan` lends them
in granules (`planner.capacity.reclaim_room_bytes`): inside SGLang's start-up (`install_startup_hooks`) every
parameter storage is adopted into ranges the device's mapper reserved right after `load_model`, and every KV
storage right after the KV pool's allocation, both before the start-up graph capture (`vmem.adopt`); every switch
moves the plan's pages on that mapper (a shrink's before the reshard, `before_weights`; a grow's after it, in
`set_layout`) before the re-view. On CPU the mapper is `vmem.host.HostMapper`: the pages really leave the weights'
addresses and appear in the KV ranges. On CUDA it is `vmem.cuda.CudaMapper` (not run on a GPU yet).
Only stdlib, torch and pat_rollout at import.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from pat_rollout.planner.capacity import reclaim_room_bytes, tokens_in_room
from pat_rollout.sglang import compat
from pat_rollout.vmem import CUDA_GRANULE, KvRegion, Mapper, ReclaimPlan, WeightStorage, apply_switch
from pat_rollout.vmem.plan import align_up

RECLAIM_ENV = "PAT_RECLAIM_WEIGHT_MEMORY"  # "1": PatRolloutConfig.reclaim_weight_memory
RECLAIM_GRANULE_ENV = "PAT_RECLAIM_GRANULE"  # the plan's granule in bytes (default CUDA's 2 MiB; CPU tests: smaller)

# Scheduler components (0.5.23) that copy the token capacity at start-up: (attribute, times kv_shard_widening).
_COMPONENTS = (("pool_stats_observer", True), ("invariant_checker", True), ("load_inquirer", True),
               ("kv_events_publisher", False))


def _storages(pool) -> dict[int, torch.UntypedStorage]:
    """The distinct storages of the pool's K and V buffers by address (0.5.23: K and V of a layer are the two
    halves of one allocation; 0.5.12: one allocation each)."""
    return {b.untyped_storage().data_ptr(): b.untyped_storage() for b in (*pool.k_buffer, *pool.v_buffer)}


def storage_ptrs(pool) -> list[int]:
    """Addresses of the KV storages, sorted: unchanged by every switch."""
    return sorted(_storages(pool))


def room_bytes(pool) -> int:
    """Bytes of KV storage this rank holds (what SGLang allocated at start-up)."""
    return sum(s.nbytes() for s in _storages(pool).values())


def capacity(pool, num_kv_heads: int, tp: int, room: float | None = None) -> int:
    """KV slots of this rank's storage (or of `room` bytes) in a TP=`tp` layout (SGLang's padding slots
    included)."""
    per_token = pool.layer_num * (pool.head_dim + pool.v_head_dim) * num_kv_heads * pool.k_buffer[0].element_size()
    return tokens_in_room(room_bytes(pool) if room is None else room, kv_bytes_per_token=per_token,
                          num_kv_heads=num_kv_heads, tp=tp)


def _flat(storage: torch.UntypedStorage, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    n = storage.nbytes() // torch.empty(0, dtype=dtype).element_size()
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, (n,))


def _review(pool, head_num: int, slots: int) -> None:
    """K/V buffers of `slots` rows of `head_num` heads over the same storages (`pool.size` already set: SGLang's
    buffer descriptors check the rows against it)."""
    d, dv = pool.head_dim, pool.v_head_dim
    ks, vs = [], []
    for k, v in zip(pool.k_buffer, pool.v_buffer):
        ksto, vsto = k.untyped_storage(), v.untyped_storage()
        if ksto.data_ptr() == vsto.data_ptr():  # one allocation, K then V (0.5.23 keeps them block-aligned)
            both = _flat(ksto, k.dtype, k.device)[: 2 * slots * head_num * d].view(2, slots, head_num, d)
            ks.append(both[0])
            vs.append(both[1])
        else:
            ks.append(_flat(ksto, k.dtype, k.device)[: slots * head_num * d].view(slots, head_num, d))
            vs.append(_flat(vsto, v.dtype, v.device)[: slots * head_num * dv].view(slots, head_num, dv))
    if any(b.shape[0] != slots for b in (*ks, *vs)):
        raise RuntimeError(f"KV storage of {room_bytes(pool)} B cannot hold {slots} slots of {head_num} heads "
                           f"x head_dim {d}/{dv} in every layer")
    pool.k_buffer, pool.v_buffer = ks, vs
    pool.head_num = head_num
    pool.row_dim = head_num * d
    if hasattr(pool, "v_row_dim"):  # 0.5.12 has none
        pool.v_row_dim = head_num * dv
    compat.refresh_kv_pointers(pool)


def set_layout(scheduler, *, num_kv_heads: int, tp: int, head_num: int) -> int:
    """View this rank's KV storage for `head_num` local heads of a TP=`tp` layout and set SGLang's token limits
    to what it holds; returns the new token capacity (`max_total_num_tokens`). The pool must be empty (the
    switch flushed it): its content is reinterpreted, not moved."""
    runner = scheduler.tp_worker.model_runner
    pool = runner.token_to_kv_pool
    if getattr(pool, "is_quantized_kv_cache", False):
        raise NotImplementedError("SglPool re-views unquantized MHA KV pools only")
    page = int(pool.page_size)
    room = _reclaim_to(scheduler, pool, tp) if reclaiming() else None
    slots = capacity(pool, num_kv_heads, tp, room) // page * page
    size = slots - page  # SGLang keeps one page of padding slots (slot 0 absorbs padded tokens' writes)
    pool.size = size
    _review(pool, head_num, slots)
    _set_limits(scheduler, size)
    return size


def _set_limits(scheduler, size: int) -> None:
    worker = scheduler.tp_worker
    runner = worker.model_runner
    runner.max_total_num_tokens = size
    if (cfg := getattr(runner, "memory_pool_config", None)) is not None and hasattr(cfg, "max_total_num_tokens"):
        cfg.max_total_num_tokens = size  # 0.5.23, as its post_capture_resize_kv_pool sets it
    alloc = scheduler.token_to_kv_pool_allocator
    alloc.size = size
    if hasattr(alloc, "num_pages"):
        alloc.num_pages = size // alloc.page_size
    alloc.clear()
    if "max_total_num_tokens" in vars(worker):  # 0.5.12 caches the limits in TpModelWorker.__init__
        worker.max_total_num_tokens = size
        worker.max_req_len = min(runner.model_config.context_len - 1, runner.max_token_pool_size - 1)
        worker.max_req_input_len = worker.max_req_len - 5
    info = worker.get_worker_info()  # SGLang's own derivation (0.5.23: logical capacity, context length)
    scheduler.max_total_num_tokens, scheduler.max_req_len, scheduler.max_req_input_len = info[0], info[4], info[5]
    widening = int(getattr(scheduler, "kv_shard_widening", 1))
    for name, widened in _COMPONENTS:
        component = getattr(scheduler, name, None)
        if component is not None and hasattr(component, "max_total_num_tokens"):
            # Some are frozen dataclasses that other components hold references to: set the field in place.
            object.__setattr__(component, "max_total_num_tokens",
                               scheduler.max_total_num_tokens * (widening if widened else 1))


def limits(scheduler) -> dict[str, int]:
    """The token limits `set_layout` sets, as this rank's scheduler holds them now."""
    pool = scheduler.tp_worker.model_runner.token_to_kv_pool
    return dict(pool_size=int(pool.size), allocator_size=int(scheduler.token_to_kv_pool_allocator.size),
                available=int(scheduler.token_to_kv_pool_allocator.available_size()),
                max_total_num_tokens=int(scheduler.max_total_num_tokens), max_req_len=int(scheduler.max_req_len),
                max_req_input_len=int(scheduler.max_req_input_len))


# ---- reclaim_weight_memory -----------------------------------------------------------------------------------


def reclaiming() -> bool:
    return os.environ.get(RECLAIM_ENV) == "1"


@dataclass
class Reclaim:
    """This rank's reclaiming state: the plan, the mapper it runs on, the weight pages' handles, the layout mapped
    now and the base KV room (bytes SGLang allocated)."""

    plan: ReclaimPlan
    mapper: Mapper
    handles: dict[int, int]
    tp: int
    base_room: int

    def room(self, tp: int) -> float:
        return reclaim_room_bytes(self.base_room, freed_bytes=self.plan.freed_bytes(tp),
                                  loss_bytes=self.plan.loss_bytes(tp))


def reclaim_state(scheduler) -> Reclaim | None:
    return getattr(scheduler.tp_worker.model_runner, "_pat_reclaim", None)


def started(scheduler) -> Reclaim:
    """This rank's reclaiming state, which SGLang's start-up made (`install_startup_hooks`)."""
    st = reclaim_state(scheduler)
    if st is None:
        raise RuntimeError("reclaim_weight_memory: this rank's weights and KV were not adopted at start-up (the "
                           "scheduler process ran without kv_room.install_startup_hooks)")
    return st


def _reclaim_to(scheduler, pool, tp: int) -> float:
    """Move the plan's pages to the TP=tp mapping (the pool is empty: the switch flushed it) and return its room."""
    st = started(scheduler)
    _move(scheduler, st, tp)
    return st.room(tp)


def _move(scheduler, st: Reclaim, tp: int) -> None:
    alloc = scheduler.token_to_kv_pool_allocator
    empty = alloc.available_size() >= alloc.size
    used = [0] * len(st.plan.kv) if empty else st.plan.kv_mapped_bytes(st.tp)  # anything live: refuse a shrink
    apply_switch(st.plan, st.mapper, st.handles, st.tp, tp, kv_used_bytes=used)
    st.tp = tp


def before_weights(scheduler, tp: int) -> None:
    """Before the weights are written for a TP=tp layout (a switch's reshard, a rollback's restore; the KV pool is
    flushed): pages the TP=tp layout keeps in the weights come home first. A shrink's reshard writes into the tails
    the larger layout lent (with a HostMapper, touching them before faults). A grow lends after the reshard has
    compacted the shards (`set_layout`)."""
    st = reclaim_state(scheduler) if reclaiming() else None
    if st is not None and st.plan.lent_pages(tp) < st.plan.lent_pages(st.tp):
        _move(scheduler, st, tp)


def _mapper_for(device: torch.device, granule: int):
    """The mapper and the torch view of its mapped bytes for `device`: HostMapper on the CPU (pages really move in
    this process's memory), CudaMapper on CUDA."""
    if device.type == "cpu":
        from pat_rollout.vmem.host import HostMapper, torch_bytes

        return HostMapper(granule), torch_bytes
    if device.type == "cuda":
        from pat_rollout.vmem.cuda import CudaMapper
        from pat_rollout.vmem.cuda import torch_bytes as cuda_bytes

        index = torch.cuda.current_device() if device.index is None else device.index
        mapper = CudaMapper(index)
        if granule % mapper.granule:
            raise ValueError(f"{RECLAIM_GRANULE_ENV}={granule} is not a multiple of the device's VMM granularity "
                             f"{mapper.granule}")
        return mapper, lambda va, n: cuda_bytes(va, n, index)
    raise NotImplementedError(f"reclaim_weight_memory on {device.type}")


# ---- adoption inside SGLang's start-up (scheduler process) ---------------------------------------------------
EVENTS: list[dict] = []  # this process's start-up sequence with the flag on (reported by `reclaim_info`)


@dataclass
class _Weights:
    """The weights adopted right after `load_model`, waiting for the KV pool (`_adopt_kv` completes the plan)."""

    mapper: Mapper
    view: object
    weights: list[WeightStorage]
    handles: dict[int, int]
    tps: list[int]
    base_tp: int
    granule: int


def _adopting(runner) -> bool:
    return reclaiming() and not getattr(runner, "is_draft_worker", False)


def _in_ranges(ptrs, ranges) -> bool:
    return all(any(a <= p < a + n for a, n in ranges) for p in ptrs)


def _event(name: str, runner) -> None:
    """Record `name` with where the parameters and KV storages are now: inside the reserved ranges or not."""
    w = getattr(runner, "_pat_weights", None)
    st = getattr(runner, "_pat_reclaim", None)
    params = [p.data_ptr() for p in runner.model.parameters()] if getattr(runner, "model", None) is not None else []
    ev: dict = dict(event=name, params_in_ranges=None, kv_storage=None, kv_at_ranges=None)
    if w is not None and params:
        ev["params_in_ranges"] = _in_ranges(params, [(x.start, align_up(x.nbytes, w.granule)) for x in w.weights])
    pool = getattr(runner, "token_to_kv_pool", None)
    if pool is not None:
        ev["kv_storage"] = storage_ptrs(pool)
        ev["kv_at_ranges"] = st is not None and ev["kv_storage"] == sorted(r.start for r in st.plan.kv)
    EVENTS.append(ev)


def install_startup_hooks() -> None:
    """reclaim_weight_memory (scheduler processes of a pool; a no-op without RECLAIM_ENV): adopt this rank's weights
    right after `ModelRunner.load_model` (before SGLang sizes and allocates its KV pool) and its KV storages right
    after the KV pool's allocation (`compat.startup_load_and_kv_methods`), both before the start-up CUDA-graph
    capture (`compat.startup_capture_method`), so no graph, pointer table or attention backend ever records an
    address outside the reserved ranges. Each step is recorded in `EVENTS` (`reclaim_info` reports it)."""
    if not reclaiming():
        return
    (lcls, lname), (kcls, kname) = compat.startup_load_and_kv_methods()
    ccls, cname = compat.startup_capture_method()
    orig_load, orig_kv, orig_capture = getattr(lcls, lname), getattr(kcls, kname), getattr(ccls, cname)

    def load_model(self, *a, **kw):
        out = orig_load(self, *a, **kw)
        if _adopting(self) and getattr(self, "_pat_weights", None) is None:
            _event("model_loaded", self)
            _adopt_weights(self)
            _event("weights_adopted", self)
        return out

    def alloc_kv(self, *a, **kw):
        # only the runner whose weights were adopted (a runner without them, e.g. 0.5.23's extra MTP runners, which
        # the pool does not run, is left alone; `started` then refuses at the pool's first RPC)
        adopting = (_adopting(self) and getattr(self, "_pat_reclaim", None) is None
                    and getattr(self, "_pat_weights", None) is not None)
        if adopting:
            _event("kv_alloc_begin", self)
        out = orig_kv(self, *a, **kw)
        if adopting:
            _event("kv_allocated", self)
            _adopt_kv(self)
            _event("kv_adopted", self)
        return out

    def capture(self, *a, **kw):
        if _adopting(self):
            _event("capture", self)
        return orig_capture(self, *a, **kw)

    setattr(lcls, lname, load_model)
    setattr(kcls, kname, alloc_kv)
    setattr(ccls, cname, capture)


def _adopt_weights(runner) -> None:
    """Plan this rank's weight storages (kept bytes per layout from the shard specs; storages shared by several
    parameters are kept whole), reserve their ranges on the device's mapper and adopt them (`vmem.adopt_weights`:
    each copied into its mapped extent and re-pointed, one at a time; parameters keep their objects; on CUDA the
    old storage goes back to the device after each). Base layout (SGLang builds the model under it)."""
    from pat_rollout.layout.layout import Layout
    from pat_rollout.sglang import pool_hooks
    from pat_rollout.sglang.live_model import sglang_specs
    from pat_rollout.vmem.adopt import adopt_weights

    state = pool_hooks.STATE
    granule = int(os.environ.get(RECLAIM_GRANULE_ENV, CUDA_GRANULE))
    model = runner.model
    specs = sglang_specs(runner.model_config.hf_config.to_dict(), int(model.model.embed_tokens.num_embeddings_padded))
    tps = sorted(int(t) for t in state.layouts)
    base_tp = len(state.base[0])
    if tps[0] != base_tp:
        raise ValueError(f"reclaim_weight_memory needs the base layout to be the smallest TP: base TP{base_tp}, "
                         f"layouts {tps}")
    if Layout(state.groups) != Layout(state.base):
        raise RuntimeError(f"reclaim_weight_memory starts in the base layout ({state.groups} != {state.base})")
    pos = {t: Layout(state.layouts[t]).position(state.rank)[1] for t in tps}
    device = next(model.parameters()).device
    mapper, view = _mapper_for(device, granule)
    weights, groups, index = [], [], {}
    for name, p in model.named_parameters():
        sto = p.untyped_storage()
        if sto.nbytes() == 0:
            continue
        if sto.data_ptr() in index:  # a view of a storage already planned: re-pointed with it, lends nothing more
            groups[index[sto.data_ptr()]].append(p)
            w = weights[index[sto.data_ptr()]]
            weights[index[sto.data_ptr()]] = WeightStorage(name=w.name, start=w.start, nbytes=w.nbytes,
                                                           kept={t: w.nbytes for t in tps})
            continue
        index[sto.data_ptr()] = len(weights)
        groups.append([p])
        spec, n, size = specs.get(name), sto.nbytes(), p.element_size()
        if spec is None or spec.dim is None or p.storage_offset() != 0:
            kept = {t: n for t in tps}  # replicated (or not at its storage's start): nothing to lend
        else:
            kept = {t: min(n, math.prod(spec.local_shape(pos[t], t)) * size) for t in tps}
        weights.append(WeightStorage(name=name, start=mapper.reserve(align_up(n, granule)), nbytes=n, kept=kept))
    sto = p = None  # the loop's last storage: the adoption frees each old storage as it goes
    handles = adopt_weights(weights, granule, mapper, view, groups)
    runner._pat_weights = _Weights(mapper=mapper, view=view, weights=weights, handles=handles, tps=tps,
                                   base_tp=base_tp, granule=granule)


def _adopt_kv(runner) -> None:
    """SGLang just allocated its KV pool (sized by its memory budget after the adopted weights): reserve one range per
    KV storage, large enough for every layout's lent pages, build the plan and adopt the storages
    (`vmem.adopt_kv`: each copied into its range's mapped base and re-pointed, one at a time, so the extra memory
    at the peak is one KV storage); SGLang's pointer tables are rebuilt over the new addresses."""
    from pat_rollout.vmem.adopt import adopt_kv

    w: _Weights = runner._pat_weights
    pool = runner.token_to_kv_pool
    if getattr(pool, "post_capture_active", False):
        raise RuntimeError("reclaim_weight_memory: SGLang's post-capture KV sizing is on (the KV pool is backed after "
                           "the graph capture); the pool sets SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=0")
    device = pool.k_buffer[0].device
    granule, tps, mapper = w.granule, w.tps, w.mapper
    kv = [sto for _, sto in sorted(_storages(pool).items())]
    # a dry plan for the lendable pages, then reservations large enough for every layout
    probe = [KvRegion(start=(1 << 60) + i * (1 << 50), base_bytes=align_up(s.nbytes(), granule),
                      reserved_bytes=align_up(s.nbytes(), granule) + (1 << 49)) for i, s in enumerate(kv)]
    lendable = ReclaimPlan.build(weights=w.weights, kv=probe, tps=tps, granule=granule).lent_pages(tps[-1])
    ext = -(-lendable // len(kv)) * granule
    regions = []
    for n in [s.nbytes() for s in kv]:  # no loop variable left holding a storage the adoption should free
        base = align_up(n, granule)
        regions.append(KvRegion(start=mapper.reserve(base + ext), base_bytes=base, reserved_bytes=base + ext))
    plan = ReclaimPlan.build(weights=w.weights, kv=regions, tps=tps, granule=granule)
    base_room = room_bytes(pool)

    def repoint_kv(_j: int, old, new) -> None:
        ptr = old.data_ptr()
        for i, (k, v) in enumerate(zip(pool.k_buffer, pool.v_buffer)):
            if k.untyped_storage().data_ptr() == ptr:
                pool.k_buffer[i] = torch.empty(0, dtype=k.dtype, device=device).set_(new, k.storage_offset(), k.shape,
                                                                                    k.stride())
            if v.untyped_storage().data_ptr() == ptr:  # 0.5.23: K then V in one allocation (V's offset kept)
                pool.v_buffer[i] = torch.empty(0, dtype=v.dtype, device=device).set_(new, v.storage_offset(), v.shape,
                                                                                    v.stride())

    pool.k_buffer, pool.v_buffer = list(pool.k_buffer), list(pool.v_buffer)
    adopt_kv(plan, mapper, w.view, kv, repoint_kv)
    compat.refresh_kv_pointers(pool)
    runner._pat_reclaim = Reclaim(plan=plan, mapper=mapper, handles=w.handles, tp=w.base_tp, base_room=base_room)


def reclaim_info(scheduler) -> dict | None:
    """What the reclaiming plan maps now (None when off or before it started): for `pat_pool_info` and the switch
    result. Besides the plan's numbers, the mapper's own state: its reserved ranges (weights: [start, bytes]; KV:
    [start, reserved bytes, base bytes]), the bytes it has mapped in each KV range, and whether every page the plan
    lends now is mapped at its KV slot (the same handle it was created for at its weight address)."""
    st = reclaim_state(scheduler)
    if st is None:
        return None
    plan, m = st.plan, st.mapper
    lent = plan.lent_pages(st.tp)
    return dict(tp=st.tp, granule=plan.granule, events=list(EVENTS), lent_pages=lent, mapper=type(m).__name__,
                reclaimed_bytes=plan.reclaimed_bytes(st.tp), freed_bytes=plan.freed_bytes(st.tp),
                room_bytes=st.room(st.tp), kv_mapped_bytes=plan.kv_mapped_bytes(st.tp),
                planned_room={t: st.room(t) for t in plan.tps}, peak_physical=m.peak_physical,
                physical_bytes=m.physical_bytes(),
                weight_ranges=[[w.start, align_up(w.nbytes, plan.granule)] for w in plan.weights],
                kv_ranges=[[r.start, r.reserved_bytes, r.base_bytes] for r in plan.kv],
                mapper_kv_mapped=[m.mapped_in(r.start, r.reserved_bytes) for r in plan.kv],
                mapper_weight_mapped=sum(m.mapped_in(w.start, align_up(w.nbytes, plan.granule))
                                         for w in plan.weights),
                lent_at_kv_slots=all(m.maps.get(plan.kv_slot(i)) == st.handles[plan.order[i]] for i in range(lent)))
