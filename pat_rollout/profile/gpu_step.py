"""One rank's decode step at a TP=k shard shape, in plain torch, and its timing (eager and CUDA graph).

The rank holds random weights of exactly `gpu_plan.rank_shape`'s shapes (heads/k, KV heads/k or one replicated
head, intermediate/k, padded vocab/k) and runs what an SGLang rank runs in one decode step, less the
collectives (the profile adds their published latency): vocab-parallel embedding lookup, per layer RMSNorm, fused
QKV GEMM, (Qwen3) q/k RMSNorm, RoPE, KV write, attention over the rank's KV heads, o_proj GEMM, residual, RMSNorm,
fused gate_up GEMM, SiLU x up, down GEMM, residual; final norm, LM-head GEMM over the rank's vocab rows, argmax.

KV is dense per layer, [batch, kv_heads, context, head_dim] for K and V (every request of a point has the same
context), read by torch's scaled_dot_product_attention with the GQA group as query rows (decode: one query per
head, no mask). SGLang's paged KV with FlashInfer/FA3 reads the same bytes through a page table; this omits that
indirection and SGLang's fused kernels (add+RMSNorm, SiLU-and-mul, RoPE+KV write).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pat_rollout.engine.ref.layers import RMSNorm, apply_rope, rope_inv_freq
from pat_rollout.profile.gpu_plan import RankShape
from pat_rollout.types import ModelSpec

# "flash": torch's FlashAttention-2 kernel only (it splits the KV length over blocks for decode-sized queries, as
# serving kernels do), so the profile says which kernel ran; "auto": torch's own choice.
SDPA_BACKENDS = {"flash": [SDPBackend.FLASH_ATTENTION], "auto": None}


class ShardStep:
    """The decode step of one rank (rank 0) of a TP=`shape.tp_size` replica, with random weights on `device`."""

    def __init__(self, spec: ModelSpec, shape: RankShape, *, device: torch.device, dtype: torch.dtype,
                 max_context: int, sdpa: str = "auto", seed: int = 0) -> None:
        if sdpa not in SDPA_BACKENDS:
            raise ValueError(f"sdpa={sdpa!r} must be one of {sorted(SDPA_BACKENDS)}")
        self.spec, self.shape, self.device, self.dtype = spec, shape, device, dtype
        self.sdpa = sdpa
        gen = torch.Generator(device=device).manual_seed(seed)
        self.w: dict[str, torch.Tensor] = {}
        self.norms: dict[str, RMSNorm] = {}
        for name, s in shape.weight_shapes:
            if name.endswith("norm.weight"):  # ones, as loaded norms are O(1): random ones would not change timing
                self.norms[name] = RMSNorm(s[0], spec.rms_norm_eps, dtype).to(device)
            else:  # in place: no second full-size temporary (a TP1 8B rank is 16 GB)
                self.w[name] = torch.empty(s, device=device, dtype=dtype).normal_(0.0, 0.02, generator=gen)
        # Rank 0 owns vocab rows [0, vocab_rows) of the padded vocab.
        self.vocab_lo, self.vocab_hi = 0, shape.vocab_rows
        freqs = torch.outer(torch.arange(max_context, dtype=torch.float32),
                            rope_inv_freq(spec.head_dim, spec.rope_theta, {}))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(device, dtype), emb.sin().to(device, dtype)

    def kv_view(self, buffer: torch.Tensor, batch: int, context: int) -> torch.Tensor:
        """[layers, 2 (K, V), batch, kv_heads, context, head_dim] over the front of a flat buffer."""
        n = self.spec.num_layers * 2 * batch * self.shape.num_kv_heads * context * self.spec.head_dim
        return buffer[:n].view(self.spec.num_layers, 2, batch, self.shape.num_kv_heads, context, self.spec.head_dim)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """One decode step: the rank's greedy token ids [B] (its vocab shard's argmax; SGLang gathers the logits
        first, a collective the profile charges separately)."""
        return self.logits(ids, positions, kv).argmax(-1)

    def logits(self, ids: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """ids [B] at positions [B]: each request's new K/V goes to slot `positions` of `kv` (see kv_view) and it
        attends over all `context` slots; returns the rank's logits [B, vocab_rows]."""
        backends = SDPA_BACKENDS[self.sdpa]
        if backends is None:
            return self._logits(ids, positions, kv)
        with sdpa_kernel(backends):  # once per step: a context per layer would add host time to eager
            return self._logits(ids, positions, kv)

    def _logits(self, ids: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        spec, shape, w, nrm = self.spec, self.shape, self.w, self.norms
        d, nh, nkv = spec.head_dim, shape.num_heads, shape.num_kv_heads
        b = ids.shape[0]
        inside = (ids >= self.vocab_lo) & (ids < self.vocab_hi)  # vocab-parallel lookup, as SGLang masks it
        x = F.embedding((ids - self.vocab_lo) * inside, w["model.embed_tokens.weight"])
        x = x * inside.unsqueeze(-1).to(x.dtype)
        cos, sin = self.cos[positions], self.sin[positions]
        slot = positions.view(b, 1, 1, 1).expand(b, nkv, 1, d)
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            h = nrm[p + "input_layernorm.weight"](x)
            q, k, v = F.linear(h, w[p + "self_attn.qkv_proj.weight"]).split([nh * d, nkv * d, nkv * d], -1)
            q, k, v = q.view(b, nh, d), k.view(b, nkv, d), v.view(b, nkv, d)
            if spec.arch == "qwen3":
                q, k = nrm[p + "self_attn.q_norm.weight"](q), nrm[p + "self_attn.k_norm.weight"](k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            kc, vc = kv[i, 0], kv[i, 1]  # [B, kv_heads, context, D]
            kc.scatter_(2, slot, k.unsqueeze(2))
            vc.scatter_(2, slot, v.unsqueeze(2))
            # The nh/nkv query heads sharing a KV head are that head's query rows: no KV expansion, no mask.
            o = F.scaled_dot_product_attention(q.view(b, nkv, nh // nkv, d), kc, vc)
            x = x + F.linear(o.reshape(b, nh * d), w[p + "self_attn.o_proj.weight"])
            h = nrm[p + "post_attention_layernorm.weight"](x)
            gate, up = F.linear(h, w[p + "mlp.gate_up_proj.weight"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"])
        x = nrm["model.norm.weight"](x)
        head = w["model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"]
        return F.linear(x, head)


@dataclass(frozen=True, kw_only=True, slots=True)
class Timing:
    """Per-step seconds: median, min and max over repeats."""

    median_s: float
    min_s: float
    max_s: float

    @classmethod
    def of(cls, per_step: list[float]) -> Timing:
        return cls(median_s=statistics.median(per_step), min_s=min(per_step), max_s=max(per_step))


def time_steps(fn, *, device: torch.device, warmup: int, repeats: int, steps_per_repeat: int) -> Timing:
    """Seconds per call of `fn`: `warmup` calls, then `repeats` timings of `steps_per_repeat` calls. On CUDA,
    events around each repeat (recorded back to back, one synchronize at the end); on CPU, perf_counter."""
    for _ in range(warmup):
        fn()
    per_step = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(repeats)]
        for start, end in events:
            start.record()
            for _ in range(steps_per_repeat):
                fn()
            end.record()
        torch.cuda.synchronize(device)
        per_step = [s.elapsed_time(e) / 1e3 / steps_per_repeat for s, e in events]
    else:
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(steps_per_repeat):
                fn()
            per_step.append((time.perf_counter() - t) / steps_per_repeat)
    return Timing.of(per_step)


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """`fn` (static inputs and outputs) captured in a CUDA graph, after warm-up on a side stream as torch
    requires (serving engines capture their decode step the same way, one graph per batch size)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph
