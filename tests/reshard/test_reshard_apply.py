"""reshard_local executed with LoopbackTransport over every transition: bit-exact, minimal bytes, in place."""

from __future__ import annotations

import pytest
import torch
from reshard_sim import full_weights, local_shards, run_devices
from transition_cases import CASES_SMALL_IDS, CHAINS, specs_for, transitions

from pat_rollout.comm.transport import LoopbackTransport
from pat_rollout.layout import Layout, plan_layout, plan_weights
from pat_rollout.layout.transition import bytes_moved
from pat_rollout.reshard.apply import reshard_local, shard, unshard

CASES = transitions()


def _execute(specs, full, src: Layout, dst: Layout):
    plan = plan_weights(src, dst, specs)
    before = {d: local_shards(full, specs, src, d) for d in src.devices}

    def step(device: int, transport: LoopbackTransport):
        out = reshard_local(before[device], plan, device, transport)
        return out, transport.bytes_sent

    return plan, before, run_devices(src.devices, step)


@pytest.mark.parametrize("name,src,dst", CASES, ids=CASES_SMALL_IDS(CASES))
def test_reshard_bit_exact(name: str, src: Layout, dst: Layout) -> None:
    specs = specs_for(name)
    full = full_weights(specs)
    plan, before, results = _execute(specs, full, src, dst)
    for device, (out, _) in results.items():
        rank = dst.position(device)[1]
        for n, spec in specs.items():
            assert torch.equal(out[n], shard(full[n], spec, rank, dst.tp_size)), (n, device)
    sent = sum(b for _, b in results.values())
    assert sent == bytes_moved(plan, dtype_bytes=4)
    if dst.tp_size % src.tp_size == 0:
        assert sent == 0
        for device, (out, _) in results.items():
            for n in plan.specs:
                assert out[n.name] is before[device][n.name], "grow must reuse the tensor object"


@pytest.mark.parametrize("name,n,tps", CHAINS)
def test_chain_execution(name: str, n: int, tps: list[int]) -> None:
    specs = specs_for(name)
    full = full_weights(specs)
    layout = Layout.uniform(n, tps[0])
    shards = {d: local_shards(full, specs, layout, d) for d in layout.devices}
    for tp in tps[1:]:
        dst = plan_layout(layout, tp)
        plan = plan_weights(layout, dst, specs)
        shards = run_devices(layout.devices, lambda d, tr: reshard_local(shards[d], plan, d, tr))
        layout = dst
        for d in layout.devices:
            rank = layout.position(d)[1]
            for p, spec in specs.items():
                assert torch.equal(shards[d][p], shard(full[p], spec, rank, tp)), (tp, p, d)


def test_grow_is_in_place_and_frees_memory() -> None:
    specs = specs_for("qwen3_gqa4")
    full = full_weights(specs)
    src = Layout.uniform(4, 1)
    dst = plan_layout(src, 4)
    plan = plan_weights(src, dst, specs)
    for release in (False, True):
        for device in (0, 3):  # rank 0 keeps its prefix in place; rank 3 compacts from far back
            shards = local_shards(full, specs, src, device)
            ptrs = {n: t.data_ptr() for n, t in shards.items()}
            nbytes = {n: t.untyped_storage().nbytes() for n, t in shards.items()}
            tensors = dict(shards)
            transport = LoopbackTransport(None, device)  # type: ignore[arg-type]  # grow never touches it
            out = reshard_local(shards, plan, device, transport, release_memory=release)
            for spec in plan.specs:
                t = out[spec.name]
                assert t is tensors[spec.name]
                assert torch.equal(t, shard(full[spec.name], spec, dst.position(device)[1], 4))
                if release:
                    assert t.untyped_storage().nbytes() == t.numel() * 4 < nbytes[spec.name]
                else:
                    assert t.data_ptr() == ptrs[spec.name], "compaction must stay in the same storage"


@pytest.mark.parametrize("second", [16, 200])  # gap 1 with 8 rows (chunked memmove) / 100 rows (temp copy)
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("device", [0, 1])
def test_compaction_with_overlapping_slices(second: int, dim: int, device: int) -> None:
    # Partitions of 2 and `second` units: rank 0 keeps [0, 1) and [2, 2 + second/2), whose new offset is
    # 1 below the old one, so the copy overlaps its own source.
    from pat_rollout.layout import Partition, ShardSpec

    width = 2 + second
    shape = (width, 3) if dim == 0 else (3, width)
    parts = (Partition(num_units=2, unit_size=1), Partition(num_units=second, unit_size=1))
    spec = ShardSpec(name="w", shape=shape, dim=dim, partitions=parts)
    full = torch.arange(3 * width, dtype=torch.float32).reshape(shape)
    src, dst = Layout.uniform(2, 1), Layout(((0, 1),))
    plan = plan_weights(src, dst, {"w": spec})
    t = full.clone()
    out = reshard_local({"w": t}, plan, device, LoopbackTransport(None, device))  # type: ignore[arg-type]
    assert out["w"] is t and torch.equal(t, shard(full, spec, device, 2))


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_shard_unshard_round_trip(tp: int) -> None:
    specs = specs_for("llama_gqa2")
    full = full_weights(specs)
    for n, spec in specs.items():
        assert torch.equal(unshard([shard(full[n], spec, r, tp) for r in range(tp)], spec, tp), full[n])


def test_shape_mismatch_names_device_and_param() -> None:
    specs = specs_for("llama_gqa2")
    full = full_weights(specs)
    src, dst = Layout.uniform(2, 1), Layout.uniform(2, 2)
    plan = plan_weights(src, dst, specs)
    shards = local_shards(full, specs, dst, 0)  # wrong (already TP2) shapes
    with pytest.raises(RuntimeError, match="device 0: .* has shape"):
        reshard_local(shards, plan, 0, LoopbackTransport(None, 0))  # type: ignore[arg-type]


def test_sglang_pool_layouts_chain_bit_exact() -> None:
    """The SGLang pool's contiguous layouts (one per TP size, ascending ranks: what SGLang's groups can express)
    reshard bit-exactly through grow and shrink; growing from TP1 is still in place."""
    from pat_rollout.config import PatRolloutConfig
    from pat_rollout.sglang.pool import pool_layouts

    cfg = PatRolloutConfig(model_path="unused", num_devices=8, backend="sglang", candidate_tps=(1, 2, 4, 8))
    layouts = pool_layouts(cfg)
    assert all(list(g) == sorted(g) for lay in layouts.values() for g in lay.groups)
    specs = specs_for(CHAINS[0][0])
    full = full_weights(specs)
    layout = layouts[1]
    shards = {d: local_shards(full, specs, layout, d) for d in layout.devices}
    for tp in (2, 4, 8, 2, 4, 1):
        dst = layouts[tp]
        plan = plan_weights(layout, dst, specs)
        shards = run_devices(layout.devices, lambda d, tr: reshard_local(shards[d], plan, d, tr))
        if layout.tp_size == 1:
            assert bytes_moved(plan, dtype_bytes=4) == 0
        layout = dst
        for d in layout.devices:
            rank = layout.position(d)[1]
            for p, spec in specs.items():
                assert torch.equal(shards[d][p], shard(full[p], spec, rank, tp)), (tp, p, d)


def test_keep_storage_holds_every_address_through_grows_and_shrinks() -> None:
    """With keep_storage (the SGLang pool's switches, for CUDA graphs per layout) every parameter stays the same
    tensor object at the same data pointer through 1 -> 2 -> 4 -> 2 -> 1 -> 4 on 4 devices, bit-exact; a shrink
    into a storage that never held the larger shard is refused by name."""
    from pat_rollout.config import PatRolloutConfig
    from pat_rollout.sglang.pool import pool_layouts

    layouts = pool_layouts(PatRolloutConfig(model_path="unused", num_devices=4, backend="sglang",
                                            candidate_tps=(1, 2, 4)))
    specs = specs_for(CHAINS[0][0])
    full = full_weights(specs)
    layout = layouts[1]
    shards = {d: local_shards(full, specs, layout, d) for d in layout.devices}
    objects = {d: dict(s) for d, s in shards.items()}
    ptrs = {d: {n: t.data_ptr() for n, t in s.items()} for d, s in shards.items()}
    for tp in (2, 4, 2, 1, 4, 1):
        dst = layouts[tp]
        plan = plan_weights(layout, dst, specs)
        shards = run_devices(layout.devices, lambda d, tr: reshard_local(shards[d], plan, d, tr, keep_storage=True))
        layout = dst
        for d in layout.devices:
            rank = layout.position(d)[1]
            for p, spec in specs.items():
                assert torch.equal(shards[d][p], shard(full[p], spec, rank, tp)), (tp, p, d)
                assert shards[d][p] is objects[d][p] and shards[d][p].data_ptr() == ptrs[d][p], (tp, p, d)

    small = {d: local_shards(full, specs, layouts[2], d) for d in layouts[2].devices}  # loaded at TP2
    plan = plan_weights(layouts[2], layouts[1], specs)
    with pytest.raises(RuntimeError, match=r"keep_storage needs \d+ bytes at its address, its storage has \d+"):
        run_devices(layouts[2].devices, lambda d, tr: reshard_local(small[d], plan, d, tr, keep_storage=True))
