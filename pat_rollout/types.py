"""Pure shared types: model shape and sampling parameters. No torch, ray or sglang imports."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """Shape of a decoder-only transformer, read from a HuggingFace config.json.

    `arch` is "llama" or "qwen3" (Qwen3 adds per-head RMSNorm on q and k).
    """

    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.arch not in ("llama", "qwen3"):
            raise ValueError(f"arch={self.arch!r} is not supported; expected 'llama' or 'qwen3'")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                     "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")

    def check_tp(self, tp_size: int) -> None:
        """Raise ValueError unless `tp_size` can shard this model (heads, KV heads, MLP)."""
        if tp_size <= 0:
            raise ValueError(f"tp_size={tp_size} must be positive")
        if self.num_heads % tp_size:
            raise ValueError(f"tp_size={tp_size} must divide num_heads={self.num_heads}")
        if self.num_kv_heads % tp_size and tp_size % self.num_kv_heads:
            raise ValueError(
                f"tp_size={tp_size} and num_kv_heads={self.num_kv_heads}: one must divide the other "
                "(KV heads are split when tp <= num_kv_heads and replicated when tp > num_kv_heads)"
            )
        if self.intermediate_size % tp_size:
            raise ValueError(f"tp_size={tp_size} must divide intermediate_size={self.intermediate_size}")

    def num_local_kv_heads(self, tp_size: int) -> int:
        """KV heads held by one rank: split, or one replicated head when tp_size > num_kv_heads."""
        return max(1, self.num_kv_heads // tp_size)

    def kv_bytes_per_token(self, tp_size: int, dtype_bytes: int) -> int:
        """Bytes of K and V for one token on one rank, all layers."""
        return 2 * self.num_layers * self.num_local_kv_heads(tp_size) * self.head_dim * dtype_bytes

    def num_params(self) -> int:
        """Parameter count (embedding counted once if tied)."""
        h, q, kv, i = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, \
            self.intermediate_size
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    @classmethod
    def from_model_path(cls, model_path: str, tp_sizes: tuple[int, ...] = ()) -> ModelSpec:
        """Read `model_path`/config.json (a HF model folder) and check that every TP size in `tp_sizes` divides
        its heads: the engine backends' check before any process starts."""
        import json
        from pathlib import Path

        cfg_path = Path(model_path) / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"model_path={model_path!r} has no config.json (missing or not a HF model folder)")
        spec = cls.from_hf_config(json.loads(cfg_path.read_text()))
        for tp in tp_sizes:
            spec.check_tp(tp)
        return spec

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelSpec:
        """Build from a parsed HuggingFace config.json dict (LlamaForCausalLM or Qwen3ForCausalLM)."""
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type", "")
        if model_type == "qwen3" or "Qwen3ForCausalLM" in archs:
            arch = "qwen3"
        elif model_type == "llama" or "LlamaForCausalLM" in archs:
            arch = "llama"
        else:
            raise ValueError(
                f"unsupported model: model_type={model_type!r} architectures={archs}; "
                "pat_rollout's reference engine supports Llama and Qwen3"
            )
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:  # transformers 5 nests it under rope_parameters
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            arch=arch,
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
        )


def _is_int(value: object) -> bool:
    """An integer (Python or numpy), not a bool and not a float that happens to be whole."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """Per-request sampling. temperature == 0 means greedy. `seed` makes sampling reproducible
    and independent of batch composition and TP layout (noise is derived from (seed, position))."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Types first: NaN passes every comparison below and 2.5 tokens would silently round up.
        for name in ("max_new_tokens", "top_k", "seed"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"{name}={getattr(self, name)!r} must be an integer")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"{name}={value!r} must be a finite number")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={self.ignore_eos!r} must be a bool")
        if bad := [t for t in self.stop_token_ids if not _is_int(t) or t < 0]:
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r}: {bad} are not non-negative integers")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1 (off) or >= 1")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Request:
    """A generation request: prompt token ids plus sampling parameters."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: prompt_token_ids is empty")


@dataclass(frozen=True, kw_only=True, slots=True)
class RequestOutput:
    """A finished request. finish_reason is "stop" (EOS/stop token), "length" or "abort"."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    log_probs: tuple[float, ...]
    finish_reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class RequestState:
    """An unfinished request lifted out of an engine so another layout can continue it.

    Everything needed to resume bit-for-bit: tokens so far, log-probs so far and the sampling
    parameters (sampling noise is a pure function of (seed, position), so no RNG state is needed).
    `num_cached_tokens` is how many leading tokens have KV in the cache (normally all but the last).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    output_log_probs: tuple[float, ...]
    sampling: SamplingParams
    num_cached_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def remaining_budget(self) -> int:
        return self.sampling.max_new_tokens - len(self.output_token_ids)
