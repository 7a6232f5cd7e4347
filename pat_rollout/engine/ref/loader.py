"""Load HuggingFace-named full tensors into a rank's local shards.

HF keeps q/k/v and gate/up separate; the engine stores them fused (`qkv_proj`, `gate_up_proj`),
exactly as `model_shard_specs` names them. A full HF tensor is one partition of a fused shard
spec; the rank copies the slice of it that `shard_intervals` assigns, so loading from disk and
`update_weights` share this single path.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pat_rollout.layout.shard import ShardSpec, shard_intervals

# HF suffix -> (fused suffix, partition index inside the fused tensor)
PACKED_MODULES_MAPPING: dict[str, tuple[str, int]] = {
    "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", 0),
    "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", 1),
    "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", 2),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", 1),
}


def map_hf_name(name: str) -> tuple[str, int]:
    """(shard-spec name, partition index) of an HF tensor name."""
    for hf_suffix, (fused, part) in PACKED_MODULES_MAPPING.items():
        if name.endswith(hf_suffix):
            return name[: -len(hf_suffix)] + fused, part
    return name, 0


def iter_safetensors(model_path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, full tensor) of the checkpoint's *.safetensors files."""
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model_path={str(model_path)!r} has no *.safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def empty_shards(specs: dict[str, ShardSpec], tp_rank: int, tp_size: int,
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    # Zeros, not empty: vocab padding rows must stay zero (they never win argmax after slicing anyway).
    return {n: torch.zeros(s.local_shape(tp_rank, tp_size), dtype=dtype) for n, s in specs.items()}


def load_full_tensor(shards: dict[str, torch.Tensor], specs: dict[str, ShardSpec], name: str, full: torch.Tensor,
                     tp_rank: int, tp_size: int) -> tuple[str, int] | None:
    """Copy this rank's slice of HF tensor `name` into `shards`; returns the (shard, partition)
    it filled, or None for tensors the engine does not keep (tied lm_head, rotary buffers)."""
    shard_name, part = map_hf_name(name)
    spec = specs.get(shard_name)
    if spec is None:
        if name == "lm_head.weight" or "rotary_emb" in name:
            return None
        raise ValueError(f"checkpoint tensor {name!r} has no shard spec in the reference model")
    local = shards[shard_name]
    with torch.no_grad():
        if spec.dim is None:
            if tuple(full.shape) != spec.shape:
                raise ValueError(f"{name}: shape {tuple(full.shape)} != expected {spec.shape}")
            local.copy_(full)
            return shard_name, 0
        parts = spec.partitions
        expected = spec.shape[: spec.dim] + (parts[part].size,) + spec.shape[spec.dim + 1 :]
        # Vocab rows are padded in the spec but not in the checkpoint.
        if tuple(full.shape) != expected and not (len(parts) == 1 and full.shape[spec.dim] <= expected[spec.dim]):
            raise ValueError(f"{name}: shape {tuple(full.shape)} != expected {expected} "
                             f"(partition {part} of {shard_name})")
        intervals = shard_intervals(spec, tp_rank, tp_size)
        part_offset = sum(p.size for p in parts[:part])
        local_offset = sum(hi - lo for lo, hi in intervals[:part])
        lo, hi = intervals[part][0] - part_offset, intervals[part][1] - part_offset
        src_hi = min(hi, full.shape[spec.dim])
        if src_hi > lo:
            local.narrow(spec.dim, local_offset, src_hi - lo).copy_(full.narrow(spec.dim, lo, src_hi - lo))
    return shard_name, part


def load_tensors(shards: dict[str, torch.Tensor], specs: dict[str, ShardSpec],
                 tensors: Iterable[tuple[str, torch.Tensor]], tp_rank: int, tp_size: int, require_all: bool) -> None:
    """Load HF-named full tensors; with require_all, ValueError naming any shard left unfilled."""
    filled = {load_full_tensor(shards, specs, n, t, tp_rank, tp_size) for n, t in tensors}
    if require_all:
        missing = [f"{n}[partition {i}]" for n, s in specs.items()
                   for i in range(max(1, len(s.partitions))) if (n, i) not in filled]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:4]}")


def load_shards(model_path: str | Path, specs: dict[str, ShardSpec], tp_rank: int, tp_size: int,
                dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """This rank's shards for layout tp_size, read from a checkpoint (e.g. for RefEngine.set_layout)."""
    shards = empty_shards(specs, tp_rank, tp_size, dtype)
    load_tensors(shards, specs, iter_safetensors(model_path), tp_rank, tp_size, require_all=True)
    return shards
