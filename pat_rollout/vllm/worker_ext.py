"""`PatWorkerExtension`: pat_rollout's methods on every vLLM worker (vLLM's `worker_extension_cls`, mixed into the
worker class in its own process), called by name over `LLMEngine.collective_rpc`, so no callable is pickled.

The hook the target design's switch RPCs (regroup, reshard, KV hand-off) will live on; today: reading a rank's
state (token ids, parameters, a request's KV blocks) for tests and the KV hand-off's read. Weight updates use vLLM's own `reload_weights` worker method instead of `model.load_weights`:
on CPU vLLM repacks linear weights after loading and leaves the parameters `load_weights` writes empty (seen on
0.32.0: "Attempted to load weight (torch.Size([128, 128])) into parameter (torch.Size([0]))"). Runs inside vLLM
workers only.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

logger = logging.getLogger(__name__)


class PatWorkerExtension:
    """Mixed into vLLM's Worker: `self.model_runner` is the worker's model runner."""

    def pat_params(self, names: list[str]) -> list[tuple[str, str, list[int], bytes]]:
        """This rank's live parameters `names` (vLLM's names, this rank's shards), packed (`pack_tensors`)."""
        params = dict(self.model_runner.get_model().named_parameters())  # type: ignore[attr-defined]
        return pack_tensors([(n, params[n]) for n in names])

    def pat_token_ids(self) -> dict[str, list[int]]:
        """Every request in the worker's persistent batch and the token ids (prompt + sampled) it holds for it:
        the ranks of one replica sample on their own, so they must agree."""
        batch: Any = self.model_runner.input_batch  # type: ignore[attr-defined]
        return {rid: batch.token_ids_cpu[i, :int(batch.num_tokens_no_spec[i])].tolist()
                for i, rid in enumerate(batch.req_ids) if rid is not None}

    def pat_save_kv(self, request_id: str, path: str, num_tokens: int) -> dict[str, Any] | None:
        """The KV hand-off's export: write the first ceil(num_tokens / block_size) KV blocks of request
        `request_id` as this rank stores them to `path` + ".rank<tp rank>", layer after layer, each layer's
        [blocks, this rank's KV heads, ...] raw (the attention backend's packing; `kv_connector.block_head_view`).
        Scratch: one request's layer at a time (a gather of its blocks on the device, then a host copy written out;
        on a GPU that copy is a device -> host DMA into host memory, the bytes never pass gloo or the RPC path).
        Returns the file's description for `kv_connector`'s manifest, or None when the request is not (or no longer)
        on this worker or has fewer blocks (the pool recomputes it)."""
        from vllm.distributed import get_tensor_model_parallel_rank

        from pat_rollout.vllm.kv_connector import block_head_view

        runner: Any = self.model_runner  # type: ignore[attr-defined]
        state = _request_state(runner, request_id)
        block_size = int(runner.cache_config.block_size)
        n = -(-num_tokens // block_size)
        if state is None or len(state.block_ids[0]) < n or n == 0:
            return None
        rank = get_tensor_model_parallel_rank()
        heads = runner.model_config.get_num_kv_heads(runner.parallel_config)
        num_blocks = runner.kv_cache_config.num_blocks
        try:
            views = [block_head_view(layer, num_blocks, heads) for layer in runner.kv_caches]
        except NotImplementedError as e:  # a KV layout this hand-off does not know: recompute, never guess
            logger.warning("pat_save_kv: %s; request %r is recomputed", e, request_id)
            return None
        blocks = torch.tensor(state.block_ids[0][:n], device=runner.kv_caches[0].device)
        shape: list[int] = []
        dtype = ""
        with open(f"{path}.rank{rank}", "wb") as f:
            for view in views:
                part = view[blocks].to("cpu").contiguous()
                shape, dtype = list(part.shape), str(part.dtype).removeprefix("torch.")
                f.write(memoryview(part.view(torch.uint8).numpy()))
        return {"path": f"{path}.rank{rank}", "rank": rank, "shape": shape, "dtype": dtype, "tokens": num_tokens,
                "layers": len(runner.kv_caches), "bytes": os.path.getsize(f"{path}.rank{rank}")}

    def pat_read_kv_blocks(self, request_id: str) -> list[tuple[str, str, list[int], bytes]]:
        """Every KV block of request `request_id` (vLLM's id with or without its `-<suffix>`) as this rank stores
        it, per attention layer [blocks, kv_heads of this rank, ...] (the block interior is the attention
        backend's own packing), packed (`pack_tensors`)."""
        runner: Any = self.model_runner  # type: ignore[attr-defined]
        state = _request_state(runner, request_id)
        if state is None:
            raise KeyError(f"request {request_id!r} is not on this worker")
        blocks = torch.tensor(state.block_ids[0])
        return pack_tensors([(str(i), layer[blocks]) for i, layer in enumerate(runner.kv_caches)])


def _request_state(runner: Any, request_id: str) -> Any:
    """The model runner's CachedRequestState of `request_id` (vLLM's id with or without its `-<suffix>`), or None."""
    return runner.requests.get(request_id) or next(
        (s for k, s in runner.requests.items() if k.rsplit("-", 1)[0] == request_id), None)


def pack_tensors(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, str, list[int], bytes]]:
    """Tensors as (name, dtype, shape, raw bytes): vLLM's RPC serializer sends a tensor inside `collective_rpc`
    arguments as nested lists without its type (seen on 0.32.0: "'list' object has no attribute 'dtype'"), bytes
    it sends as they are."""
    out = []
    for name, t in named:
        t = t.detach().to("cpu").contiguous()
        out.append((name, str(t.dtype).removeprefix("torch."), list(t.shape), t.view(torch.uint8).numpy().tobytes()))
    return out


def unpack_tensors(packed: list[tuple[str, str, list[int], bytes]]) -> list[tuple[str, torch.Tensor]]:
    return [(name, torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape))
            for name, dtype, shape, raw in packed]
