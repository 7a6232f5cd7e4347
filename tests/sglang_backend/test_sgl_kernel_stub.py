"""The sgl_kernel CPU stand-in computes the same results as plain reference implementations."""

from __future__ import annotations

import pytest

# "sglang.srt": a bare "sglang" could resolve to a namespace package of a same-named folder on sys.path.
pytest.importorskip("sglang.srt")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.sglang


def _stub():
    import sgl_kernel

    if not getattr(sgl_kernel, "IS_PAT_STUB", False):
        pytest.skip("the real sgl_kernel is installed; the stand-in is not in use")
    return sgl_kernel


def test_assign_req_to_token_pool_matches_reference():
    sk = _stub()
    gen = torch.Generator().manual_seed(0)
    pool_len = 32
    req_to_token = torch.randint(0, 1000, (6, pool_len), generator=gen, dtype=torch.int32)
    rows = torch.tensor([4, 1, 3], dtype=torch.int64)
    start = torch.tensor([0, 7, 30], dtype=torch.int64)
    end = torch.tensor([5, 7, 32], dtype=torch.int64)  # the middle request allocates nothing
    out_cache_loc = torch.arange(100, 107, dtype=torch.int64)
    expected = req_to_token.clone()
    expected[4, 0:5] = torch.tensor([100, 101, 102, 103, 104], dtype=torch.int32)
    expected[3, 30:32] = torch.tensor([105, 106], dtype=torch.int32)
    sk.assign_req_to_token_pool_cpu(rows, req_to_token, start, end, out_cache_loc, pool_len)
    assert torch.equal(req_to_token, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_all_layer_kv_cache_matches_reference(dtype):
    sk = _stub()
    gen = torch.Generator().manual_seed(1)
    # Two layers of K and V, [slots, heads, head_dim] like MHATokenToKVPool's NHD buffers.
    bufs = [torch.randn(16, 2, 8, generator=gen).to(dtype) for _ in range(4)]
    ref = [b.clone() for b in bufs]
    src = torch.tensor([3, 4, 5, 9], dtype=torch.int64)
    tgt = torch.tensor([4, 5, 6, 0], dtype=torch.int64)  # overlaps src: all reads happen before writes
    for r in ref:
        r[tgt] = r[src].clone()
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs], dtype=torch.int64)
    sk.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, r in zip(bufs, ref):
        assert torch.equal(b, r)


def test_speculative_kernels_fail_loudly():
    sk = _stub()
    with pytest.raises(NotImplementedError, match="speculative"):
        sk.verify_tree_greedy_cpu()


def test_host_cache_transfers_fail_loudly():
    """SGLang 0.5.12 imports `sgl_kernel.kvcacheio` at module level; the CPU tests never move KV to a host pool."""
    _stub()
    from sgl_kernel import kvcacheio

    with pytest.raises(NotImplementedError, match="host KV cache"):
        kvcacheio.transfer_kv_per_layer()
