"""Create tiny random Llama / Qwen3 checkpoints with `save_pretrained` (config.json + safetensors).

The weights are random but the files are real HuggingFace checkpoints, so the engine's loading
path is exercised exactly as for a downloaded model. Initialisation uses a larger std than HF's
default so logits are spread out and greedy decoding is far from ties.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

TINY_PRESETS: dict[str, dict[str, Any]] = {
    # GQA 4 heads / 2 KV heads: TP=4 replicates KV heads, TP=8 is rejected.
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=250, max_position_embeddings=512),
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=250, max_position_embeddings=512,
                  tie_word_embeddings=True),
    # Demo size (~110M params): wide and shallow, so a decode step's matmuls weigh about as much as the ~6
    # collectives TP adds per step (gloo over loopback costs ~1 ms each on these machines).
    "llama-demo": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=2, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=4096, max_position_embeddings=4096),
}


def make_tiny_model(path: str | os.PathLike, arch: str = "llama", seed: int = 0, init_std: float = 0.2,
                    dtype: str = "float32", **overrides: Any) -> Path:
    """Write a random model of `arch` ("llama", "qwen3" or a TINY_PRESETS key) to `path`; return it.

    Idempotent: an existing checkpoint with the same config is reused.
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    if arch not in TINY_PRESETS:
        raise ValueError(f"unknown tiny model {arch!r}; choose one of {sorted(TINY_PRESETS)}")
    kwargs = {**TINY_PRESETS[arch], "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
              "initializer_range": init_std, **overrides}
    config_cls = Qwen3Config if arch.startswith("qwen3") else LlamaConfig
    config = config_cls(**kwargs)
    path = Path(path)
    marker = path / "pat_tiny.json"
    fingerprint = json.dumps({"arch": arch, "seed": seed, "dtype": dtype, **kwargs}, sort_keys=True, default=str)
    if marker.exists() and marker.read_text() == fingerprint:
        return path
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    with torch.no_grad():  # norms at 1 +- noise so every weight matters in tests
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    marker.write_text(fingerprint)
    return path
