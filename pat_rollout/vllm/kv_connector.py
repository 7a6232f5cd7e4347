"""`PatKVConnector`: vLLM's KV-connector hook (`KVConnectorBase_V1`) that loads a migrated request's KV into the
blocks the new engine's scheduler allocated for it, so the resubmitted request prefills only its last token.

Every engine of a `VllmPool` is started with `kv_transfer_config = {kv_connector: "PatKVConnector",
kv_connector_module_path: "pat_rollout.vllm.kv_connector", kv_role: "kv_consumer"}` (`pool.engine_args`). A switch
writes each migrated request's KV per old rank into files (`worker_ext.PatWorkerExtension.pat_save_kv`, one layer at a
time) and resubmits the request with a manifest in `SamplingParams.extra_args["kv_transfer_params"]["pat_kv"]`:

    {"tokens": n, "layers": L, "ranks": [[{"path", "shape", "dtype", "src": [a, b], "dst": c}, ...] per new rank]}

(`pool.kv_manifest`, from `kv.plan_kv`): new TP rank k copies KV heads [a, b) of the file written by an old rank
(its layer tensor `shape` = [blocks, that rank's KV heads, ...]) into its own heads [c, c + b - a).

- Scheduler side (engine-core process): `get_num_new_matched_tokens` reports the manifest's `n` tokens (context - 1)
  as an external hit, once per request; `update_state_after_alloc` / `build_connector_meta` hand the block ids the
  scheduler allocated to the workers. vLLM schedules the load synchronously (`has_sync_kv_loads`: the load runs
  before the step's forward) and counts the tokens in the request's `num_cached_tokens`.
- Worker side (every rank): `start_load_kv` copies, per request and per layer, the whole per-head sub-blocks of the
  first ceil(n / block_size) blocks (a head's sub-block is self-contained in every layout vLLM uses, including the
  CPU kernel's packing; positions past n are overwritten by the request's own prefill). Scratch: one old rank's
  layer of one request at a time, in host memory; on a GPU it is read into a pinned buffer and copied host -> device
  (never through gloo, never the RPC path). A missing or mismatched file raises: the step fails, the engine dies,
  and the pool's switch (phase `kv_import`) rolls back.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def block_head_view(layer: torch.Tensor, num_blocks: int, num_heads: int) -> torch.Tensor:
    """A view of one attention layer's KV tensor as [blocks, heads, ...] (same storage), for the layouts known:
    CPU attention's [blocks, heads, block_size, 2 * head_size] (as is) and FlashAttention's
    [2, blocks, block_size, heads, head_size] (permuted). Anything else raises rather than guess."""
    s = tuple(layer.shape)
    if len(s) >= 2 and s[0] == num_blocks and s[1] == num_heads:
        return layer
    if len(s) == 5 and s[0] == 2 and s[1] == num_blocks and s[3] == num_heads:
        return layer.permute(1, 3, 0, 2, 4)
    raise NotImplementedError(f"KV migration: unknown KV-cache layout {s} ({num_blocks} blocks, {num_heads} KV heads "
                              "on this rank)")


def load_request_kv(kv_layers: list[torch.Tensor], block_ids: list[int], manifest: dict[str, Any], rank: int,
                    num_blocks: int, num_heads: int) -> int:
    """Copy the migrated KV of one request (`manifest`, see the module doc) into `block_ids` of this rank's layers
    (`kv_layers`, in layer order), one old rank's layer at a time. Returns the bytes read."""
    sources = manifest["ranks"][rank]
    n_blocks = max((s["shape"][0] for s in sources), default=0)
    if len(block_ids) < n_blocks:
        raise RuntimeError(f"KV migration: {n_blocks} blocks to load, {len(block_ids)} allocated")
    if manifest["layers"] != len(kv_layers):
        raise RuntimeError(f"KV migration: {manifest['layers']} layers exported, this model has {len(kv_layers)}")
    read = 0
    device = kv_layers[0].device
    for src in sources:
        dtype = getattr(torch, src["dtype"])
        shape = list(src["shape"])
        nbytes = math.prod(shape) * dtype.itemsize
        a, b, c = src["src"][0], src["src"][1], src["dst"]
        # Host staging, one buffer per source file reused for every layer: pinned on a GPU host, so each layer
        # reaches the device in one DMA of the whole (contiguous) buffer; the head slice is taken on the device.
        # Extra memory at the peak: one old rank's layer of this request, once in host memory, once on the device
        # (only a GPU run shows the DMA and the device scratch; on the CPU `.to(device)` is the buffer itself).
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        idx = torch.tensor(block_ids[:shape[0]], device=device)
        with open(src["path"], "rb") as f:
            for i, layer in enumerate(kv_layers):
                dst = block_head_view(layer, num_blocks, num_heads)
                if dst.dtype != dtype or list(dst.shape[2:]) != shape[2:]:
                    raise RuntimeError(f"KV migration: exported {src['dtype']} {shape} does not fit the layer's "
                                       f"{dst.dtype} {list(dst.shape)}")
                f.seek(i * nbytes)
                if f.readinto(memoryview(buf.numpy())) != nbytes:
                    raise RuntimeError(f"KV migration: {src['path']} is short (layer {i})")
                # a synchronous copy (non_blocking=False): the buffer may be refilled for the next layer at once
                dst[idx, c:c + b - a] = buf.to(device).view(dtype).view(shape)[:, a:b]
                read += nbytes * (b - a) // shape[1]
    return read


@dataclass
class PatKVMetadata(KVConnectorMetadata):
    """Per step: (vLLM request id, block ids of its first KV-cache group, manifest) to load before the forward."""

    loads: list[tuple[str, list[int], dict[str, Any]]] = field(default_factory=list)


class PatKVConnector(KVConnectorBase_V1):
    """Loads migrated KV (see the module doc); never saves (the export is a worker RPC before the old engine stops)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._pending: dict[str, dict[str, Any]] = {}  # scheduler: allocated, not yet sent to the workers
        self._loaded: set[str] = set()  # scheduler: loaded once; a later re-admission (preemption) recomputes
        self._kv_layers: list[torch.Tensor] = []  # worker: this rank's KV tensors in layer order
        self._num_blocks = kv_cache_config.num_blocks
        model_config, parallel = vllm_config.model_config, vllm_config.parallel_config
        self._num_heads = model_config.get_num_kv_heads(parallel)

    # ---- scheduler side ---------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        manifest = (request.kv_transfer_params or {}).get("pat_kv")
        if not manifest or request.request_id in self._loaded:
            return 0, False
        return max(0, int(manifest["tokens"]) - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self._pending[request.request_id] = request.kv_transfer_params["pat_kv"]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = PatKVMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            manifest = self._pending.pop(new.req_id, None)
            if manifest is not None:
                meta.loads.append((new.req_id, list(new.block_ids[0]), manifest))
                self._loaded.add(new.req_id)
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._pending.pop(request.request_id, None)
        self._loaded.discard(request.request_id)
        return False, None

    # ---- worker side ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        self._kv_layers = [kv_caches[n] for n in sorted(kv_caches, key=extract_layer_index)]

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank

        meta = self._get_connector_metadata()
        assert isinstance(meta, PatKVMetadata)
        rank = get_tensor_model_parallel_rank()
        for req_id, block_ids, manifest in meta.loads:
            load_request_kv(self._kv_layers, block_ids, manifest, rank, self._num_blocks, self._num_heads)
            logger.debug("PatKVConnector rank %d: %s: %d migrated tokens loaded", rank, req_id, manifest["tokens"])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # start_load_kv loads every layer before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
