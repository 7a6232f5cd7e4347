"""KV room per layout inside an SglPool scheduler process.

SGLang allocates its KV storage once, for the base layout (token count from `mem_fraction_static`, heads per
rank of `initial_tp`). A switch keeps that storage (no allocation: the same bytes, the same addresses) and views
it again for the new per-rank head count, so a TPk replica holds k times the tokens of a TP1 replica
(`planner.capacity.tokens_in_room`, the one rule the planner and the simulator use), then sets every token limit
SGLang's scheduler admits against: the pool's and allocator's size (free list rebuilt), the model runner's and
scheduler's `max_total_num_tokens`, `max_req_len` / `max_req_input_len`, and the copies SGLang's scheduler
components keep. `max_prefill_tokens`, `chunked_prefill_size` and the new-token ratio are not capacities
(server-args caps and a ratio of the free room) and stay. The tokenizer manager keeps the base layout's
`max_req_input_len`, the smallest (the base is the smallest TP). Only stdlib, torch and pat_rollout at import.
"""

from __future__ import annotations

import torch

from pat_rollout.planner.capacity import tokens_in_room
from pat_rollout.sglang import compat

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


def capacity(pool, num_kv_heads: int, tp: int) -> int:
    """KV slots of this rank's storage in a TP=`tp` layout (SGLang's padding slots included)."""
    per_token = pool.layer_num * (pool.head_dim + pool.v_head_dim) * num_kv_heads * pool.k_buffer[0].element_size()
    return tokens_in_room(room_bytes(pool), kv_bytes_per_token=per_token, num_kv_heads=num_kv_heads, tp=tp)


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
    slots = capacity(pool, num_kv_heads, tp) // page * page
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
