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
