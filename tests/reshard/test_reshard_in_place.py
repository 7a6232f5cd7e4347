"""In-place shrink and bounded transfer rounds of reshard_local (LoopbackTransport, one thread per device).

A shrink expands each parameter inside its own storage (kept slices moved back to front, the rest received straight
into place) and moves data in rounds of at most `chunk_bytes`: measured with `comm.alloc_spy.AllocSpy` (every tensor
storage reshard_local allocates), the peak extra bytes per device stay within one chunk (the round's non-contiguous
send/receive scratch), where assembling new shards needed about one sharded model. The loopback's own copies of
sent messages (a mailbox a fast device can fill ahead of a slow one) are left out of the count: gloo sends from
the buffer itself.
"""

from __future__ import annotations

import math

import pytest
import torch
from reshard_sim import full_weights, local_shards, run_devices
from transition_cases import CASES_SMALL_IDS, specs_for, transitions

from pat_rollout.comm.alloc_spy import AllocSpy
from pat_rollout.layout import Layout, ShardSpec, model_shard_specs, plan_layout, plan_weights
from pat_rollout.layout.transition import bytes_moved
from pat_rollout.reshard.apply import _memmove_back, reshard_local, shard
from pat_rollout.types import ModelSpec

CASES = transitions()


@pytest.mark.parametrize("name,src,dst", CASES[::3], ids=CASES_SMALL_IDS(CASES[::3]))
@pytest.mark.parametrize("keep_storage", [False, True])
def test_reshard_bit_exact_with_tiny_chunks(name: str, src: Layout, dst: Layout, keep_storage: bool) -> None:
    """Rounds of 12 bytes split every transfer by rows (dim 0) or outer rows (dim > 0): still bit-exact, same bytes."""
    specs = specs_for(name)
    full = full_weights(specs)
    plan = plan_weights(src, dst, specs)
    before = {d: local_shards(full, specs, src, d) for d in src.devices}
    if keep_storage:  # as in the pool, every storage can hold the larger of the two shards
        after = {d: local_shards(full, specs, dst, d) for d in src.devices}
        before = {d: {n: _in_storage(t, max(t.numel(), after[d][n].numel())) for n, t in sh.items()}
                  for d, sh in before.items()}
    ptrs = {d: {n: t.data_ptr() for n, t in sh.items()} for d, sh in before.items()}

    def step(device, transport):
        return reshard_local(before[device], plan, device, transport, keep_storage=keep_storage, chunk_bytes=12), \
            transport.bytes_sent

    results = run_devices(src.devices, step)
    for device, (out, _) in results.items():
        rank = dst.position(device)[1]
        for n, spec in specs.items():
            assert torch.equal(out[n], shard(full[n], spec, rank, dst.tp_size)), (n, device)
            if keep_storage and n in {s.name for s in plan.specs}:
                assert out[n] is before[device][n] and out[n].data_ptr() == ptrs[device][n], (n, device)
    assert sum(b for _, b in results.values()) == bytes_moved(plan, dtype_bytes=4)


def _in_storage(t: torch.Tensor, numel: int) -> torch.Tensor:
    """`t`'s values at the front of a storage of `numel` elements."""
    store = torch.empty(numel, dtype=t.dtype)
    store[: t.numel()].copy_(t.reshape(-1))
    return store[: t.numel()].view(t.shape)


def _uncounted_sends(transport) -> None:
    """The loopback's clone of each sent message is made outside the spy."""
    from torch.utils._python_dispatch import _disable_current_modes

    orig = transport.submit_send

    def submit_send(tensor, dst_device, task_id):
        with _disable_current_modes():
            orig(tensor, dst_device, task_id)

    transport.submit_send = submit_send


def _big_specs() -> dict[str, ShardSpec]:
    """A Llama layer large enough that one shard is many chunks (column- and row-parallel, vocab-parallel)."""
    model = ModelSpec(arch="llama", num_layers=1, hidden_size=64, num_heads=8, num_kv_heads=4, head_dim=8,
                      intermediate_size=128, vocab_size=96)
    return model_shard_specs(model, 4)


def _shrink(src_tp: int, dst_tp: int, n: int, chunk: int, keep_storage: bool, base_storage: bool):
    specs = _big_specs()
    full = full_weights(specs)
    src, dst = Layout.uniform(n, src_tp), Layout.uniform(n, dst_tp)
    plan = plan_weights(src, dst, specs)
    before = {}
    for d in src.devices:
        shards = local_shards(full, specs, src, d)
        if base_storage:  # the pool's storages: allocated for the base layout's (larger) shard
            big = local_shards(full, specs, dst, d)
            shards = {name: _in_storage(t, big[name].numel()) for name, t in shards.items()}
        before[d] = shards
    spies = {}

    def step(device, transport):
        _uncounted_sends(transport)
        with AllocSpy() as spy:
            out = reshard_local(before[device], plan, device, transport, keep_storage=keep_storage, chunk_bytes=chunk)
        spies[device] = spy
        return out

    results = run_devices(src.devices, step)
    for device, out in results.items():
        rank = dst.position(device)[1]
        for name, spec in specs.items():
            assert out[name] is before[device][name], name  # the same tensor object
            assert torch.equal(out[name], shard(full[name], spec, rank, dst.tp_size)), (name, device)
    shard_bytes = {d: sum(t.numel() * 4 for t in results[d].values()) for d in results}
    return spies, shard_bytes, specs, plan


@pytest.mark.parametrize("src_tp,dst_tp,n", [(2, 1, 2), (4, 1, 4), (4, 2, 4), (8, 2, 8)])
def test_shrink_in_place_peak_extra_within_chunks(src_tp: int, dst_tp: int, n: int) -> None:
    """keep_storage (SglPool's uniform layouts, storages sized for the base layout). A device whose new shard
    contains what it held expands in place: peak extra bytes <= one chunk, not a shard. A device whose new shard is
    another rank's (uniform TP4 -> TP2: devices 1 and 3) cannot; its new shards are made one parameter at a time
    (from the round of a parameter's first transfer to its last, then copied into the old storage and freed): peak
    <= the largest parameter's new shard + one chunk, not the sum over parameters."""
    chunk = 2048
    spies, shard_bytes, specs, plan = _shrink(src_tp, dst_tp, n, chunk, keep_storage=True, base_storage=True)
    largest = max(math.prod(s.local_shape(0, dst_tp)) for s in specs.values()) * 4
    nested = {d: all(sum(k.length for k in plan.keeps_for(d) if k.name == sp.name)
                     == sp.local_shape(plan.src.position(d)[1], src_tp)[sp.dim] for sp in plan.specs)
              for d in spies}
    assert nested[0]
    for d, spy in spies.items():
        bound = chunk if nested[d] else largest + chunk
        assert spy.peak <= bound, (d, nested[d], spy.peak, bound)
        assert shard_bytes[d] > 2 * largest > 20 * chunk  # what assembling all new shards allocated at once


def test_shrink_in_place_reference_pool_resizes_one_parameter_at_a_time() -> None:
    """release_memory (the reference pool: storages shrunk by earlier grows): each storage is resized to its new
    shard in turn. What stays allocated afterwards is exactly the growth of the shards (new - old); the peak above
    that is at most the largest new parameter (resize_ copies into a fresh allocation) plus one chunk."""
    chunk = 2048
    spies, shard_bytes, specs, plan = _shrink(2, 1, 2, chunk, keep_storage=False, base_storage=False)
    largest = max(math.prod(s.shape) for s in specs.values()) * 4
    for d, spy in spies.items():
        old_bytes = sum(math.prod(s.local_shape(plan.src.position(d)[1], 2)) * 4 for s in specs.values())
        assert spy.live == shard_bytes[d] - old_bytes  # the storages' growth, nothing else left behind
        assert spy.peak <= spy.live + largest + chunk, (d, spy.peak, spy.live, largest)


@pytest.mark.parametrize("n,src,dst,scratch", [(10, 0, 3, 2), (10, 0, 3, 100), (50, 2, 3, 4), (50, 2, 3, 1000),
                                               (7, 1, 9, 3), (64, 0, 1, 8)])
def test_memmove_back_overlapping(n: int, src: int, dst: int, scratch: int) -> None:
    flat = torch.arange(dst + n + 5, dtype=torch.float32)
    want = flat.clone()
    want[dst : dst + n] = flat[src : src + n].clone()
    _memmove_back(flat, src, dst, n, scratch)
    assert torch.equal(flat, want)


def test_chain_through_shrinks_in_place_keeps_addresses() -> None:
    """TP1 -> 4 -> 2 -> 1 -> 2 -> 4 with keep_storage: every parameter at its TP1 address throughout."""
    specs = specs_for("qwen3_gqa4")
    full = full_weights(specs)
    layout = Layout.uniform(4, 1)
    shards = {d: local_shards(full, specs, layout, d) for d in layout.devices}
    ptrs = {d: {k: t.data_ptr() for k, t in s.items()} for d, s in shards.items()}
    for tp in (4, 2, 1, 2, 4):
        dst = plan_layout(layout, tp)
        plan = plan_weights(layout, dst, specs)
        shards = run_devices(layout.devices, lambda d, tr: reshard_local(shards[d], plan, d, tr, keep_storage=True,
                                                                          chunk_bytes=16))
        layout = dst
        for d in layout.devices:
            rank = layout.position(d)[1]
            for p, spec in specs.items():
                assert torch.equal(shards[d][p], shard(full[p], spec, rank, tp)), (tp, d, p)
                assert shards[d][p].data_ptr() == ptrs[d][p], (tp, d, p)
