"""CPU reference engine, nano-vllm style: paged KV cache, continuous batching, TP over gloo.

Files: config (options), loader (HF -> fused shards), layers / model / attention (the network),
sequence / block_manager / scheduler (bookkeeping), sampler, engine (RefEngine). Imports torch and
safetensors, never ray, sglang or transformers.
"""

from pat_rollout.engine.ref.config import RefEngineConfig
from pat_rollout.engine.ref.engine import RefEngine

__all__ = ["RefEngine", "RefEngineConfig"]
