"""One-GPU check of `vmem.cuda.CudaMapper` (the CUDA driver's virtual memory API through ctypes) running a
reclaiming plan, in pure torch + the driver: reserve a weight and a KV range, map 2 MiB pages, write through torch
tensors over the addresses, lend the tail pages of the weight storage to the KV range (grow TP1 -> TP4) and take
them back (shrink), and check:
- the kept head of the weights and the KV base keep their bytes;
- each lent page arrives in the KV range with its bytes (the same physical page: a move, not a new allocation),
  and bytes written into the KV range come back under the weight addresses after the shrink;
- a shrink while live KV lies in the pages to give back is refused before anything is unmapped;
- `torch.cuda.mem_get_info` drops by the 5 pages at start-up, does not move at the grow or the shrink, and
  comes back at close.
The same scenario runs on the CPU against FakeMapper (tests/vmem/test_page_move_check.py). Skips without CUDA
(no torch CUDA device or no libcuda.so.1). Runs in a few seconds."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pat_rollout.vmem.check import page_move_check  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture
def mapper():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")
    from pat_rollout.vmem.cuda import CudaMapper

    torch.cuda.set_device(0)
    torch.empty(1, device="cuda")  # the primary context, current on this thread: the driver's VMM calls need one
    try:
        m = CudaMapper(0)
    except OSError as e:
        pytest.skip(f"libcuda.so.1 not loadable: {e}")
    yield m
    torch.cuda.synchronize()
    m.close()


def test_cuda_mapper_moves_weight_tail_pages_into_the_kv_range(mapper):
    from pat_rollout.vmem.cuda import torch_bytes

    g = mapper.granule
    assert g > 0 and (2 << 20) % g == 0, f"granule {g}: the plan assumes 2 MiB pages on CUDA"

    def read(va: int, n: int) -> bytes:
        torch.cuda.synchronize()
        return torch_bytes(va, n).cpu().numpy().tobytes()

    def write(va: int, b: bytes) -> None:
        torch_bytes(va, len(b)).copy_(torch.frombuffer(bytearray(b), dtype=torch.uint8))
        torch.cuda.synchronize()

    def free() -> int:
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]

    seen = page_move_check(mapper, read, write, free)
    assert seen["order"] == [2, 3, 1]
    assert seen["head_kept"] and seen["kv_base_kept"]
    assert seen["grow_kv"] == [True] * 3, "a lent page did not arrive in the KV range with its bytes"
    assert seen["shrink_weights"] == [True] * 3, "a page taken back did not bring the KV range's bytes"
    assert "shrink tp 4 -> 1: KV region 0 holds live KV" in seen["refused"]
    f0, f1, f2, f3, f4 = seen["free"]
    slack = g  # the driver's own bookkeeping (page tables) may move the free count by less than a page
    assert abs((f0 - f1) - 5 * g) <= slack, f"start-up mapped 5 pages: free {f0} -> {f1}"
    assert abs(f2 - f1) <= slack and abs(f3 - f1) <= slack, f"a move allocated or freed memory: {seen['free']}"
    assert abs(f4 - f0) <= slack, f"close did not give the pages back: {seen['free']}"
    assert mapper.maps == {} and mapper.handles == {}


def test_a_parameter_adopted_into_cuda_mapper_ranges_gives_the_same_matmul(mapper):
    """`vmem.adopt` on CUDA: a Linear's weight and bias and a KV-like storage are copied into CudaMapper ranges and
    re-pointed (same Parameter objects); the matmul through them equals the one before, bit for bit; a grow moves
    the weight's tail page into the KV range with its bytes, a shrink brings it home and the matmul is unchanged."""
    from pat_rollout.vmem import KvRegion, ReclaimPlan, WeightStorage, apply_switch
    from pat_rollout.vmem.adopt import adopt
    from pat_rollout.vmem.cuda import torch_bytes
    from pat_rollout.vmem.plan import align_up

    g = mapper.granule
    assert g == 2 << 20, f"granule {g}: this check's sizes assume 2 MiB pages"
    torch.manual_seed(0)
    lin = torch.nn.Linear(1024, 1024, device="cuda")  # weight: 4 MiB (two 2 MiB pages), bias 4 KiB
    x = torch.randn(8, 1024, device="cuda")
    before = lin(x).clone()
    params = [lin.weight, lin.bias]
    ids = [id(p) for p in params]
    kv_old = torch.arange(1 << 18, dtype=torch.float32, device="cuda")  # 1 MiB
    weights = [WeightStorage(name=str(i), start=mapper.reserve(align_up(p.untyped_storage().nbytes(), g)),
                             nbytes=p.untyped_storage().nbytes(),
                             kept={1: p.untyped_storage().nbytes(), 2: p.untyped_storage().nbytes() // 2})
               for i, p in enumerate(params)]
    base = align_up(kv_old.untyped_storage().nbytes(), g)
    kv_start = mapper.reserve(base + 2 * g)
    plan = ReclaimPlan.build(weights=weights, kv=[KvRegion(start=kv_start, base_bytes=base,
                                                           reserved_bytes=base + 2 * g)], tps=(1, 2), granule=g)
    held = {}
    handles = adopt(plan, mapper, torch_bytes, [[p] for p in params], [kv_old.untyped_storage()],
                    lambda j, old, new: held.update({j: new}))
    del kv_old
    assert [id(p) for p in (lin.weight, lin.bias)] == ids
    for p, w in zip(params, plan.weights):
        assert w.start <= p.data_ptr() < w.start + align_up(w.nbytes, g)
    kv = torch.empty(0, device="cuda").set_(held[0], 0, (1 << 18,))
    assert torch.equal(kv, torch.arange(1 << 18, dtype=torch.float32, device="cuda"))
    assert torch.equal(lin(x), before), "the matmul through the adopted weight differs"
    assert plan.lent_pages(2) == 1  # the weight's second 2 MiB page
    page = plan.order[0]
    tail = torch_bytes(page, g).clone()
    torch.cuda.synchronize()
    apply_switch(plan, mapper, handles, 1, 2, kv_used_bytes=[0])
    assert mapper.mapped_in(kv_start, base + 2 * g) == base + g
    assert torch.equal(torch_bytes(plan.kv_slot(0), g), tail), "the lent page did not bring its bytes"
    torch.cuda.synchronize()
    apply_switch(plan, mapper, handles, 2, 1, kv_used_bytes=[0])
    assert torch.equal(lin(x), before), "the matmul differs after the page came home"
    del lin, params, kv
    held.clear()  # nothing may reference the mapped memory when the fixture closes the mapper
