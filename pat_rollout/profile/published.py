"""GPU step-time model built only from published figures (../shared/GPU_FIGURES.md), and the profiles the
planner reads, made from it. Pure stdlib. NOT a measurement: every number is a cited figure, derived from cited
figures by the formula below, or a stated assumption (listed as such in the profile's meta).

    step_s(tp=k, batch=b, context=c) = F + W / (k * BW * e) + [k > 1] * 2 * L * ar_latency + b * m_k(c)
    m_k(c) = (comp_1 + c * kv_bytes_per_token / (BW * e)) / (k * eff_k)

F: fixed per-step time (launch, scheduler); W: weight bytes; BW: HBM bandwidth, e: its achieved share; L layers
(two all-reduces each); m_k: marginal seconds per running request at TP k, comp_1 its compute/host part at TP1;
eff_k: per-GPU decode throughput of TP k relative to TP1 under load (the one quantity no source pins down: the
published bracket, low / central / high variant). F, e and comp_1 are solved from three SGLang Llama-3-8B H100
points (sglang#1008: TP1 bs1 7.37 ms, TP8 bs1 3.35 ms, TP1 bs128 11.84 ms, context ~130). Under load the
all-reduce bytes, smaller GEMMs and TP scheduling cost are inside eff_k (no published all-reduce bandwidth figure
for these message sizes), so the explicit all-reduce term is its latency.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pat_rollout.profile.model import DATA_DIR, SCHEMA_VERSION, ProfileModelShape

VARIANTS = ("low", "central", "high")
FIG = "../shared/GPU_FIGURES.md"  # the project's file of published GPU figures, each with its source
SRC = {
    "bs1": "sgl-project/sglang issue 1008: Llama-3-8B H100 bench_latency in 128/out 8, CUDA graph: TP1 bs1 7.37 ms, "
           "TP8 bs1 3.35 ms",
    "bs128": "sgl-project/sglang issue 1008: Llama-3-8B H100 TP1 bs128, context ~130: 11.84 ms/step",
    "ar": "GPU_FIGURES 'All-reduce, small messages, NVLink': vllm PR 24111 (~7 us TP2, 13 us TP6), "
          "symm-mem-recipes PR 3 (10.8 us one-shot), nccl issue 1259 (~6 us): realistic 7-15 us per all-reduce",
    "eff": "GPU_FIGURES 'TP cost under load' bracket (Gyges arXiv 2509.19729, NIM docs, vllm#8089, vllm#16300, "
           "sglang#1857, UniRL#40): per-GPU decode throughput vs TP1 at high concurrency TP2 80-95%, TP4 50-85%, "
           "TP8 35-70%",
    "h100": "GPU_FIGURES 'Memory and sizes': H100 SXM 80 GB HBM3 ~3.35 TB/s",
    "h200": "GPU_FIGURES 'Memory and sizes': H200 141 GB HBM3e ~4.8 TB/s",
    "llama": "GPU_FIGURES 'Memory and sizes': Llama-3.1-8B 32 layers, 8 KV heads x 128, 128 KiB KV/token bf16, "
             "~16 GB weights (8,030,261,248 params x 2 B)",
    "qwen": "GPU_FIGURES 'Memory and sizes': Qwen3-14B 40 layers, 8 KV heads x 128, 160 KiB KV/token bf16, "
            "~29.5 GB weights (14,768,296,960 params x 2 B)",
    "mem": "verl examples/grpo_trainer/run_qwen2-7b_math.sh via GPU_FIGURES 'RL rollout context': "
           "gpu_memory_utilization=0.6 (rollout colocated with FSDP training)",
}
# Bracket ends and its midpoint, per TP size (eff_1 = 1 by definition).
EFF = {"low": {2: 0.80, 4: 0.50, 8: 0.35}, "central": {2: 0.875, 4: 0.675, 8: 0.525},
       "high": {2: 0.95, 4: 0.85, 8: 0.70}}
AR_LATENCY_S = {"low": 15e-6, "central": 11e-6, "high": 7e-6}  # ends and middle of 7-15 us
GPUS = {"h100": ("8x NVIDIA H100 SXM 80GB (NVLink)", 80e9, 3.35e12),
        "h200": ("8x NVIDIA H200 141GB (NVLink)", 141e9, 4.8e12)}
MODELS = {
    "llama31_8b": ("meta-llama/Llama-3.1-8B (bf16)", ProfileModelShape(
        num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
        param_bytes=2 * 8_030_261_248, dtype_bytes=2), "llama"),
    "qwen3_14b": ("Qwen/Qwen3-14B (bf16)", ProfileModelShape(
        num_layers=40, hidden_size=5120, num_heads=40, num_kv_heads=8, head_dim=128,
        param_bytes=2 * 14_768_296_960, dtype_bytes=2), "qwen"),
}
ANCHOR_PARAM_BYTES = 2 * 8_030_261_248  # the sglang#1008 points are Llama-3-8B
ANCHOR_CONTEXT = 130
ASSUMED = {  # not published: used for capacity and reconfiguration only, and said so
    "activation_reserve_bytes": 2e9,
    "kv_bytes_per_s": 200e9, "kv_latency_s": 50e-6, "reshard_bytes_per_s": 300e9, "reshard_fixed_s": 2e-3,
    "group_switch_s": 0.02,
}
MEM_FRACTION = 0.6
GRID_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
GRID_CONTEXTS = (128, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuStepModel:
    """The published-figure step-time model of one (GPU, model, variant); `decode_step_s` and `prefill_s` have
    LatencyModel's signatures, so the simulator can step with it directly (its ground truth)."""

    shape: ProfileModelShape
    hbm_bytes_per_s: float
    hbm_eff: float
    fixed_s: float
    comp1_s: float
    ar_latency_s: float
    eff: dict[int, float]

    def _marginal(self, tp: int, context: float) -> float:
        m1 = self.comp1_s + context * self.shape.kv_bytes_per_token() / (self.hbm_bytes_per_s * self.hbm_eff)
        return m1 / (tp * self.eff.get(tp, 1.0))

    def _base(self, tp: int) -> float:
        ar = 2 * self.shape.num_layers * self.ar_latency_s if tp > 1 else 0.0
        return self.fixed_s + self.shape.param_bytes / (tp * self.hbm_bytes_per_s * self.hbm_eff) + ar

    def decode_step_s(self, tp: int, batch: float, context: float) -> float:
        if tp not in (1, *self.eff):
            raise ValueError(f"tp={tp} is not modelled; known {sorted((1, *self.eff))}")
        return 0.0 if batch <= 0 else self._base(tp) + batch * self._marginal(tp, context)

    def prefill_tokens_per_s(self, tp: int) -> float:
        """Prefill is compute-bound: one token costs what one request's decode compute costs (comp_1), split
        over tp GPUs at the under-load efficiency eff_k."""
        return tp * self.eff.get(tp, 1.0) / self.comp1_s

    def prefill_s(self, tp: int, num_tokens: int) -> float:
        return 0.0 if num_tokens <= 0 else self.fixed_s + num_tokens / self.prefill_tokens_per_s(tp)


def solve_anchors(variant: str) -> tuple[float, float, float]:
    """(hbm_eff, fixed_s, comp1_s at the anchor model) from the three sglang#1008 points and the variant's
    all-reduce latency and TP8 efficiency. Closed form: the batch-1 TP1 - TP8 difference fixes hbm_eff."""
    t1_bs1, t8_bs1, t1_bs128 = 7.37e-3, 3.35e-3, 11.84e-3
    m1 = (t1_bs128 - t1_bs1) / 127  # marginal seconds per request at context ~130
    w_s = ANCHOR_PARAM_BYTES / GPUS["h100"][2]
    ar = 2 * 32 * AR_LATENCY_S[variant]
    # t1 - t8 = w_s/e * (1 - 1/8) - ar + m1 * (1 - 1/(8 eff8))
    e = w_s * (7 / 8) / (t1_bs1 - t8_bs1 + ar - m1 * (1 - 1 / (8 * EFF[variant][8])))
    fixed = t1_bs1 - w_s / e - m1
    kv = MODELS["llama31_8b"][1].kv_bytes_per_token()
    comp1 = m1 - ANCHOR_CONTEXT * kv / (GPUS["h100"][2] * e)
    if not (0 < e <= 1 and fixed > 0 and comp1 > 0):
        raise ValueError(f"anchors give hbm_eff={e}, fixed_s={fixed}, comp1_s={comp1} for variant {variant!r}")
    return e, fixed, comp1


def gpu_step_model(gpu: str, model: str, variant: str) -> GpuStepModel:
    """The model for `gpu` in GPUS, `model` in MODELS, `variant` in VARIANTS. Other GPUs and models keep the H100
    Llama anchors' F, e and per-parameter compute (comp_1 scales with parameter count), with their own
    bandwidth and shape."""
    if gpu not in GPUS or model not in MODELS or variant not in VARIANTS:
        raise ValueError(f"gpu={gpu!r} model={model!r} variant={variant!r}: known {sorted(GPUS)}, {sorted(MODELS)}, "
                         f"{VARIANTS}")
    e, fixed, comp1 = solve_anchors(variant)
    shape = MODELS[model][1]
    return GpuStepModel(shape=shape, hbm_bytes_per_s=GPUS[gpu][2], hbm_eff=e, fixed_s=fixed,
                        comp1_s=comp1 * shape.param_bytes / ANCHOR_PARAM_BYTES, ar_latency_s=AR_LATENCY_S[variant],
                        eff=dict(EFF[variant]))


def profile_name(gpu: str, model: str, variant: str) -> str:
    return f"{gpu}_{model}_{variant}"


def published_profile(gpu: str, model: str, variant: str) -> dict[str, Any]:
    """Schema-v1 profile dict of `gpu_step_model` on the grid, with every figure's source in meta."""
    m = gpu_step_model(gpu, model, variant)
    e, fixed, comp1 = solve_anchors(variant)
    hw, hbm, bw = GPUS[gpu]
    tps = (1, 2, 4, 8)
    decode = [{"tp": tp, "batch": b, "context": c, "step_s": round(m.decode_step_s(tp, b, c), 9)}
              for tp in tps for b in GRID_BATCHES for c in GRID_CONTEXTS]
    sources = {
        "hbm_bytes_per_s": f"{bw:.4g}: {SRC[gpu]}", "hbm_bytes": f"{hbm:.4g}: {SRC[gpu]}",
        "anchors": f"{SRC['bs1']}; {SRC['bs128']}",
        "hbm_eff": f"{e:.4f}: solved from the anchors ({FIG})", "fixed_step_s": f"{fixed:.6g}: solved from the anchors",
        "comp1_s": f"{m.comp1_s:.6g}: solved from the anchors ({comp1:.6g} s for 8B), scaled by parameter count",
        "ar_latency_s": f"{AR_LATENCY_S[variant]:.3g} ({variant} end of 7-15 us): {SRC['ar']}",
        "eff": f"{EFF[variant]} ({variant}): {SRC['eff']}",
        "model_shape": SRC[MODELS[model][2]], "mem_fraction": f"{MEM_FRACTION}: {SRC['mem']}",
        "prefill": "tokens/s = tp * eff_tp / comp1_s, fixed = fixed_step_s (derived, no prefill figure used)",
    }
    if gpu != "h100" or model != "llama31_8b":
        sources["transfer"] = ("no latency figure for this GPU/model was used: H100 Llama-3-8B anchors' hbm_eff, "
                               "fixed_step_s and per-parameter compute, with this GPU's bandwidth and this shape")
    notes = (f"NOT MEASURED: published-figures model ({variant} TP-cost variant) from "
             f"pat_rollout.profile.published ({FIG}). Assumed, not published: "
             + ", ".join(f"{k}={v}" for k, v in ASSUMED.items()))
    return {
        "schema_version": SCHEMA_VERSION,
        "meta": {"hardware": hw, "model": MODELS[model][0], "backend": "sglang", "source": "published-figures",
                 "notes": notes, "variant": variant, "sources": sources, "assumed": dict(ASSUMED)},
        "model": {k: getattr(m.shape, k) for k in ProfileModelShape.__slots__},
        "decode": decode,
        "prefill": [{"tp": tp, "tokens_per_s": round(m.prefill_tokens_per_s(tp), 3), "fixed_s": round(fixed, 9)}
                    for tp in tps],
        "kv_transfer": {"bandwidth_bytes_per_s": ASSUMED["kv_bytes_per_s"], "latency_s": ASSUMED["kv_latency_s"]},
        "reshard": {"bandwidth_bytes_per_s": ASSUMED["reshard_bytes_per_s"], "fixed_s": ASSUMED["reshard_fixed_s"]},
        "group_switch_s": ASSUMED["group_switch_s"],
        "memory": {"hbm_bytes": hbm, "mem_fraction": MEM_FRACTION,
                   "activation_reserve_bytes": ASSUMED["activation_reserve_bytes"]},
    }


def all_published() -> dict[str, dict[str, Any]]:
    """Every (gpu, model, variant) profile by builtin name."""
    return {profile_name(g, mo, v): published_profile(g, mo, v) for g in GPUS for mo in MODELS for v in VARIANTS}


def check_bracket(m: GpuStepModel, batch: int = 256, context: int = ANCHOR_CONTEXT) -> dict[int, float]:
    """Per-GPU throughput of each TP relative to TP1 at (batch, context): what the variant is meant to hold."""
    t1 = m.decode_step_s(1, batch, context)
    return {tp: t1 / (tp * m.decode_step_s(tp, batch, context)) for tp in (1, *m.eff)}



def write_published_profiles(out_dir: Path = DATA_DIR) -> list[Path]:
    """Regenerate data/<gpu>_<model>_<variant>.json (run after changing a figure above)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, prof in all_published().items():
        path = out_dir / f"{name}.json"
        path.write_text(_dumps(prof))
        paths.append(path)
    return paths


def _dumps(prof: dict[str, Any]) -> str:
    """JSON with one decode point per line (small diffs), everything else indented."""
    body = {k: v for k, v in prof.items() if k != "decode"}
    text = json.dumps(body, indent=1)
    points = ",\n".join("  " + json.dumps(p) for p in prof["decode"])
    return text[:-2] + ',\n "decode": [\n' + points + "\n ]\n}\n"
