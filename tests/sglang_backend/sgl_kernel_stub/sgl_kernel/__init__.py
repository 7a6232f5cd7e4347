"""CPU stand-in for `sgl_kernel` (test-only): pure PyTorch versions of exactly the functions SGLang 0.5.23
imports from `sgl_kernel` when `SGLANG_USE_CPU_ENGINE=1` on an x86 CPU without AMX.

PyPI's `sglang-kernel` wheels are CUDA-only (`import sgl_kernel` fails on `libcuda.so.1`), yet with the CPU
engine enabled SGLang imports two CPU kernels at module level:

* `assign_req_to_token_pool_cpu` (sglang/srt/mem_cache/allocation.py): writes newly allocated KV slots of
  each request into its `req_to_token` row;
* `copy_all_layer_kv_cache_cpu` (sglang/kernels/ops/kvcache/cache_move.py): copies KV slot rows inside
  each layer buffer (used when KV slots are moved, e.g. speculative decoding / hisparse).

SGLang 0.5.12 also imports `sgl_kernel.kvcacheio` (host KV cache transfers) at module level: the submodule
`kvcacheio.py` here makes each of its functions raise (nothing on the CPU tests' path calls them).

Everything else (RMSNorm, fused add+RMSNorm, SiLU-and-mul, rotary embedding) goes through SGLang's own
`forward_native` on such a CPU, because the fused `torch.ops.sgl_kernel.*_cpu` ops are used only when
`cpu_has_amx_support()` is true, which needs AMX tiles and a registered `torch.ops.sgl_kernel`
namespace. This module registers no `torch.ops.sgl_kernel` ops, so that gate stays false.
Put its parent folder first on sys.path (and PYTHONPATH for SGLang's spawned scheduler processes) only
when the real `sgl_kernel` cannot be imported.
"""

from __future__ import annotations

import ctypes

import torch

IS_PAT_STUB = True


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """For request i: req_to_token[req_pool_indices[i], start[i]:end[i]] = the next (end[i] - start[i])
    entries of out_cache_loc, taken in request order (same math as the Triton kernel
    `assign_req_to_token_pool`)."""
    assert req_to_token.shape[1] == pool_len, (req_to_token.shape, pool_len)
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    offset = 0
    for row, lo, hi in zip(rows, starts, ends):
        n = hi - lo
        if n > 0:
            req_to_token[row, lo:hi] = out_cache_loc[offset:offset + n].to(req_to_token.dtype)
        offset += n


def _byte_rows(ptr: int, num_rows: int, stride: int) -> torch.Tensor:
    buf = (ctypes.c_uint8 * (num_rows * stride)).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.uint8).view(num_rows, stride)


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """For every buffer b (base address data_ptrs[b], row size strides[b] bytes): row tgt_loc[j] = row
    src_loc[j]. All source rows are read before any target row is written, so overlapping src/tgt sets
    are safe (as in the Triton kernel `copy_all_layer_kv_cache_tiled`)."""
    if tgt_loc.numel() == 0:
        return
    src = src_loc.to(torch.int64)
    tgt = tgt_loc.to(torch.int64)
    num_rows = int(torch.maximum(src.max(), tgt.max()).item()) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        rows = _byte_rows(int(ptr), num_rows, int(stride))
        rows[tgt] = rows[src].clone()


def _unsupported(name: str, reason: str = "implements no speculative-decoding kernels"):
    """A named function that fails loudly: `sgl_kernel.<name>: the CPU stand-in <reason>`."""

    def fn(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: the CPU stand-in {reason}")

    fn.__name__ = name.rpartition(".")[2]
    return fn


# Imported at module level by sglang/kernels/ops/speculative/* when is_cpu(), but only called with
# speculative decoding enabled, which the CPU tests never turn on: calling one fails loudly.
_SPECULATIVE_ONLY = (
    "fill_bonus_tokens_cpu",
    "fill_accept_out_cache_loc_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
)
for _name in _SPECULATIVE_ONLY:
    globals()[_name] = _unsupported(_name)
