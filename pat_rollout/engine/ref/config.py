"""RefEngineConfig: validated options of the CPU reference engine, and reading config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from pat_rollout.engine.ref.sequence import max_cached_tokens
from pat_rollout.types import ModelSpec

DTYPES = ("float32", "float64", "bfloat16")
# RoPE variants we implement exactly; anything else would silently give wrong logits.
ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True, kw_only=True, slots=True)
class RefEngineConfig:
    """Options of one reference-engine rank.

    num_kv_blocks is per rank (each rank caches only its KV heads). max_prefill_tokens bounds the
    prompt tokens admitted per step; the first admitted request may exceed it so long prompts
    still run. eos_token_ids overrides config.json's eos_token_id when not None.
    """

    model_path: str
    dtype: str = "float32"
    max_tp: int = 8
    block_size: int = 16
    num_kv_blocks: int = 256
    max_num_seqs: int = 64
    max_prefill_tokens: int = 2048
    eos_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; expected one of {DTYPES}")
        for name in ("max_tp", "block_size", "num_kv_blocks", "max_num_seqs", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        path = Path(self.model_path)
        if not (path / "config.json").is_file():
            raise ValueError(f"model_path={self.model_path!r} has no config.json (missing or not a HF model folder)")

    def hf_config(self) -> dict:
        return json.loads((Path(self.model_path) / "config.json").read_text())

    def model_spec(self) -> ModelSpec:
        """ModelSpec from config.json, rejecting features the reference model does not implement."""
        cfg = self.hf_config()
        spec = ModelSpec.from_hf_config(cfg)
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise ValueError(f"{self.model_path}: attention_bias/mlp_bias=True is not supported by the ref engine")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{self.model_path}: hidden_act={cfg['hidden_act']!r} is not supported (need 'silu')")
        rope_type = rope_parameters(cfg).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"{self.model_path}: rope_type={rope_type!r} is not supported; expected {ROPE_TYPES}")
        if self.eos_token_ids is not None:
            spec = replace(spec, eos_token_ids=tuple(self.eos_token_ids))
        return spec

    def check_tp(self, spec: ModelSpec, tp_size: int) -> None:
        """ValueError unless `tp_size` can shard `spec` and nests in the vocab padded for max_tp."""
        spec.check_tp(tp_size)
        if self.max_tp % tp_size:
            raise ValueError(f"tp_size={tp_size} must divide max_tp={self.max_tp} (vocab is padded for max_tp)")


def rope_parameters(cfg: dict) -> dict:
    """RoPE settings: transformers 5 nests them in rope_parameters, older configs use rope_scaling."""
    return cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}


def check_request(request_id: str, prompt: tuple[int, ...], max_new_tokens: int, spec: ModelSpec,
                  config: RefEngineConfig) -> None:
    """ValueError if a request can never run: bad token ids, too long, or more KV than the pool."""
    if bad := [t for t in prompt if not 0 <= t < spec.vocab_size]:
        raise ValueError(f"request {request_id!r}: token ids {bad[:8]} outside vocab [0, {spec.vocab_size})")
    total = len(prompt) + max_new_tokens
    if total > spec.max_position_embeddings:
        raise ValueError(f"request {request_id!r}: prompt {len(prompt)} + max_new_tokens {max_new_tokens} = "
                         f"{total} > max_position_embeddings={spec.max_position_embeddings}")
    need = -(-max_cached_tokens(len(prompt), max_new_tokens) // config.block_size)
    if need > config.num_kv_blocks:
        raise ValueError(f"request {request_id!r} can never fit: needs {need} KV blocks (prompt {len(prompt)} + "
                         f"max_new_tokens {max_new_tokens} - 1 tokens, block_size {config.block_size}) but the pool "
                         f"has num_kv_blocks={config.num_kv_blocks}")
