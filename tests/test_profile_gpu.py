"""The one-GPU shard-shape profiler (pat_rollout.profile.gpu) on CPU: exact TP-k shard shapes, a step that computes
what the reference engine computes, the CLI writing a profile LatencyModel loads, skipped points filled and marked,
and a time budget that stops cleanly and still writes what it measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import count
from pathlib import Path

import pytest
import torch

from pat_rollout.layout.shard import padded_vocab_size
from pat_rollout.profile.gpu import run
from pat_rollout.profile.gpu_plan import (
    DEFAULT_BATCHES,
    DEFAULT_CONTEXTS,
    DEFAULT_TPS,
    EST_START_S,
    MODELS,
    Budget,
    GpuGrid,
    allreduce_s,
    estimate_run_s,
    fits,
    kv_budget_bytes,
    rank_shape,
)
from pat_rollout.profile.gpu_profile import FILLED, PointResult, TpResult, bracket_of, fill_grid, tp_efficiency
from pat_rollout.profile.model import LatencyModel
from pat_rollout.profile.published import AR_LATENCY_S, GPUS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("tp", (1, 2, 4, 8))
def test_rank_shape_is_the_tp_shard(model: str, tp: int) -> None:
    spec = MODELS[model][1]
    s = rank_shape(spec, tp, max_tp=8)
    nkv = max(1, spec.num_kv_heads // tp)
    assert (s.num_heads, s.num_kv_heads, s.intermediate_size) == (spec.num_heads // tp, nkv,
                                                                 spec.intermediate_size // tp)
    assert s.kv_replication == (tp // spec.num_kv_heads if tp > spec.num_kv_heads else 1)
    assert s.vocab_rows == padded_vocab_size(spec.vocab_size, 8) // tp
    w, d, h = dict(s.weight_shapes), spec.head_dim, spec.hidden_size
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        assert w[p + "self_attn.qkv_proj.weight"] == ((spec.num_heads // tp + 2 * nkv) * d, h)
        assert w[p + "self_attn.o_proj.weight"] == (h, spec.num_heads // tp * d)
        assert w[p + "mlp.gate_up_proj.weight"] == (2 * spec.intermediate_size // tp, h)
        assert w[p + "mlp.down_proj.weight"] == (h, spec.intermediate_size // tp)
        assert w[p + "input_layernorm.weight"] == (h,)  # replicated
        assert (p + "self_attn.q_norm.weight" in w) == (spec.arch == "qwen3")
    assert w["model.embed_tokens.weight"] == w["lm_head.weight"] == (s.vocab_rows, h)
    assert s.kv_bytes_per_token(spec.num_layers, d) == spec.kv_bytes_per_token(tp, 2)


def test_published_model_shapes_and_replication() -> None:
    llama, qwen = MODELS["llama31_8b"][1], MODELS["qwen3_14b"][1]
    assert llama.num_params() == 8_030_261_248 and qwen.num_params() == 14_768_296_960  # the published counts
    got = {(m, tp): (s.num_heads, s.num_kv_heads, s.intermediate_size, s.vocab_rows)
           for m in ("llama31_8b", "qwen3_14b") for tp in (1, 8) for s in [rank_shape(MODELS[m][1], tp, max_tp=8)]}
    assert got == {("llama31_8b", 1): (32, 8, 14336, 128256), ("llama31_8b", 8): (4, 1, 1792, 16032),
                   ("qwen3_14b", 1): (40, 8, 17408, 151936), ("qwen3_14b", 8): (5, 1, 2176, 18992)}
    assert rank_shape(llama, 1, max_tp=8).weight_bytes == 2 * llama.num_params()
    # q/k norms (head_dim each, per layer) are in the shard specs but not in the published parameter count.
    assert rank_shape(qwen, 1, max_tp=8).weight_bytes == 2 * (qwen.num_params() + 2 * 128 * 40)
    tiny = MODELS["tiny_llama"][1]
    assert [rank_shape(tiny, tp, max_tp=8).kv_replication for tp in (1, 2, 4, 8)] == [1, 1, 2, 4]


@pytest.mark.parametrize("model", ["tiny_llama", "qwen3_14b"])
def test_per_rank_bytes_shrink_with_tp(model: str) -> None:
    spec = MODELS[model][1]
    shapes = [rank_shape(spec, tp, max_tp=8) for tp in (1, 2, 4, 8)]
    wb = [s.weight_bytes for s in shapes]
    assert wb == sorted(wb, reverse=True) and len(set(wb)) == 4
    assert all(w * s.tp_size >= wb[0] for w, s in zip(wb, shapes))  # replicated norms (and KV heads) add bytes
    kv = [s.kv_bytes_per_token(spec.num_layers, spec.head_dim) for s in shapes]
    assert kv == sorted(kv, reverse=True)


def _reference_logits(spec, step, ids, pos, kv, block_size=4):
    """The reference engine's model (paged KV, tested against HF) on the same weights and cache."""
    from pat_rollout.comm.tp_context import TPContext
    from pat_rollout.engine.ref.attention import build_metadata
    from pat_rollout.engine.ref.model import CausalLM
    from pat_rollout.layout.shard import model_shard_specs

    ref = CausalLM(spec, model_shard_specs(spec, 8), TPContext(), torch.float32, {})
    state = {**step.w, **{n: m.weight for n, m in step.norms.items()}}
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    b, context = ids.shape[0], kv.shape[4]
    per_seq = -(-context // block_size)
    pool = torch.zeros(spec.num_layers, 2, b * per_seq * block_size, kv.shape[3], spec.head_dim)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b)]
    for i in range(b):
        lo = i * per_seq * block_size
        pool[:, :, lo:lo + context] = kv[:, :, i].transpose(2, 3)  # [L, 2, heads, T, D] -> [L, 2, T, heads, D]
    md = build_metadata([int(p) for p in pos], [int(p) + 1 for p in pos], tables, block_size,
                        ref.rotary.cos, ref.rotary.sin)
    return ref(ids, md, pool)


@pytest.mark.parametrize("model,sdpa", [("tiny_llama", "auto"), ("tiny_qwen3", "auto"), ("tiny_qwen3", "flash")])
def test_tp1_step_equals_reference_engine(model: str, sdpa: str) -> None:
    from pat_rollout.profile.gpu_step import ShardStep

    spec = MODELS[model][1]
    step = ShardStep(spec, rank_shape(spec, 1, max_tp=8), device=torch.device("cpu"), dtype=torch.float32,
                     max_context=64, sdpa=sdpa, seed=3)
    gen = torch.Generator().manual_seed(2)  # not the global RNG: the test must not depend on what ran before it
    for norm in step.norms.values():  # non-trivial norms, so a misplaced one shows
        norm.weight.uniform_(0.5, 1.5, generator=gen)
    b, context = 3, 20
    buf = torch.randn(spec.num_layers * 2 * b * 2 * context * spec.head_dim, generator=torch.Generator().manual_seed(1))
    kv = step.kv_view(buf, b, context)
    ids = torch.tensor([5, 77, 249])
    pos = torch.full((b,), context - 1)
    with torch.inference_mode():
        expected = _reference_logits(spec, step, ids, pos, kv.clone())
        full = step.logits(ids, pos, kv)
        got = full[:, :spec.vocab_size]  # padded vocab rows dropped, as the engine does
        # forward's argmax runs over the rank's whole shard, padded rows included (random weights here)
        assert torch.equal(step.forward(ids, pos, kv), full.argmax(-1))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tp", (1, 2, 4, 8))
def test_step_tensors_have_the_rank_shapes_and_write_one_slot(tp: int) -> None:
    from pat_rollout.profile.gpu_step import ShardStep

    spec = MODELS["tiny_qwen3"][1]
    shape = rank_shape(spec, tp, max_tp=8)
    step = ShardStep(spec, shape, device=torch.device("cpu"), dtype=torch.bfloat16, max_context=32)
    held = {**{n: tuple(t.shape) for n, t in step.w.items()},
            **{n: tuple(m.weight.shape) for n, m in step.norms.items()}}
    assert held == dict(shape.weight_shapes)
    assert all(t.dtype == torch.bfloat16 for t in step.w.values())
    b, context = 4, 16
    buf = torch.zeros(spec.num_layers * 2 * b * shape.num_kv_heads * context * spec.head_dim, dtype=torch.bfloat16)
    kv = step.kv_view(buf, b, context)
    with torch.inference_mode():
        out = step.forward(torch.arange(b), torch.full((b,), context - 1), kv)
    assert out.shape == (b,) and int(out.max()) < shape.vocab_rows
    written = (kv != 0).any(dim=-1)  # [L, 2, B, heads, T]
    assert written[..., -1].all() and not written[..., :-1].any()


def _load(path: Path) -> tuple[dict, LatencyModel]:
    data = json.loads(path.read_text())
    return data, LatencyModel.from_json(path)


def test_cli_writes_a_profile_latency_model_loads(tmp_path: Path) -> None:
    spec = MODELS["tiny_qwen3"][1]
    # 0.03 MiB of KV: at TP1 (128 B/token) batch 4 x context 64 (32 KiB) does not fit; at TP2+ (64 B/token) it does.
    cmd = [sys.executable, "-m", "pat_rollout.profile.gpu", "--device", "cpu", "--models", "tiny_qwen3",
           "--tps", "1,2,4,8", "--batches", "1,2,4", "--contexts", "16,32,64", "--warmup", "1", "--repeats", "3",
           "--steps-per-repeat", "2", "--kv-limit-mib", "0.03", "--threads", "1", "--out-dir", str(tmp_path)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    path = tmp_path / "cpu_tiny_qwen3_measured.json"
    assert f"wrote {path}" in res.stdout
    data, m = _load(path)
    assert m.tps == (1, 2, 4, 8)
    meta = m.meta
    assert meta["source"] == "measured" and meta["graph"] is False and meta["step_s_column"] == "eager"
    assert meta["torch"] == torch.__version__ and meta["cuda"] is None and "dense" in meta["kv_layout"]
    assert {"decode_compute", "allreduce_s", "prefill", "kv_transfer", "reshard"} <= set(meta["sources"])
    assert "memory" not in data  # no device memory on CPU
    assert meta["skipped"] == {"1": [[4, 64]], "2": [], "4": [], "8": []}
    assert meta["filled"] == [[1, 4, 64]] and meta["stopped"] == {} and meta["omitted_tps"] == {}
    for tp, s in meta["rank_shapes"].items():
        shape = rank_shape(spec, int(tp), max_tp=8)
        assert (s["num_heads"], s["num_kv_heads"], s["kv_replication"], s["intermediate_size"], s["vocab_rows"],
                s["weight_bytes"]) == (shape.num_heads, shape.num_kv_heads, shape.kv_replication,
                                       shape.intermediate_size, shape.vocab_rows, shape.weight_bytes)
    points = {(p["tp"], p["batch"], p["context"]): p for p in data["decode"]}
    assert set(points) == {(tp, b, c) for tp in (1, 2, 4, 8) for b in (1, 2, 4) for c in (16, 32, 64)}
    for (tp, b, c), p in points.items():
        assert p["allreduce_s"] == (0.0 if tp == 1 else (2 * spec.num_layers + 2) * AR_LATENCY_S["central"])
        assert p["step_s"] == pytest.approx(p["compute_s"] + p["allreduce_s"])
        assert p["eager_s"] == p["compute_s"]  # no graph on CPU: the eager column is the step
        assert ("filled" in p) == ((tp, b, c) == (1, 4, 64)) and ("step_s_range" in p) != ("filled" in p)
        if "step_s_range" in p:
            lo, hi = p["step_s_range"]
            assert lo <= p["step_s"] <= hi
        assert m.decode_step_s(tp, b, c) >= p["step_s"]  # the loaded grid is the monotone envelope of these
    filled = points[(1, 4, 64)]
    slope = (points[(1, 4, 32)]["compute_s"] - points[(1, 4, 16)]["compute_s"]) / 16
    assert filled["compute_s"] == pytest.approx(points[(1, 4, 32)]["compute_s"] + max(slope, 0.0) * 32)
    assert filled["filled"] == FILLED
    assert all(m.prefill_s(tp, 100) > 0 for tp in m.tps)
    assert meta["tp_efficiency"] == []  # no batch of 64 or more in this grid


def test_budget_stop_keeps_whole_columns_and_writes_what_it_measured(tmp_path: Path) -> None:
    ticks = count()
    grid = GpuGrid(tps=(1, 2), batches=(1, 2, 4), contexts=(8, 16, 32, 64), warmup=1, repeats=1,
                   steps_per_repeat=1)
    # A clock that advances one second per reading (about one per point): each TP size's share of 20 s runs out
    # inside its second context column, deterministically.
    paths = run(["tiny_llama"], grid, device_name="cpu", dtype_name="float32", graph=False, max_seconds=20.0,
                out_dir=tmp_path, tag="t", reserve_bytes=0.0, kv_limit_bytes=None, ar_variant="central",
                clock=lambda: float(next(ticks)))
    assert paths == [tmp_path / "t_tiny_llama_measured.json"]
    data, m = _load(paths[0])
    meta = data["meta"]
    assert meta["stopped"], "the budget should have stopped the run"
    for tp, (b, c) in meta["stopped"].items():
        assert (int(tp), b, c) not in {(p["tp"], p["batch"], p["context"]) for p in data["decode"]}
    for tp in m.tps:  # whole context columns, smallest first, every batch
        pts = [(p["batch"], p["context"]) for p in data["decode"] if p["tp"] == tp]
        contexts = sorted({c for _, c in pts})
        assert contexts == list(grid.contexts[:len(contexts)])
        assert sorted(pts) == sorted((b, c) for b in grid.batches for c in contexts)
        if str(tp) in meta["stopped"]:
            assert max(contexts) < meta["stopped"][str(tp)][1]
    assert set(meta["omitted_tps"]) | {str(t) for t in m.tps} == {"1", "2"}
    # What the budget cut from a column is not lost: every point measured is in the grid or in unused_points.
    kept = {(p["tp"], p["batch"], p["context"]) for p in data["decode"]}
    unused = {(tp, b, c) for tp, b, c, _ in meta["unused_points"]["rows"]}
    assert unused and not unused & kept
    assert all(tp in (1, 2) and c in grid.contexts and b in grid.batches for tp, b, c in unused)


def test_out_of_memory_point_is_skipped_and_filled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pat_rollout.profile.gpu as gpu

    real = gpu._measure_point

    def measure(step, buffer, batch, context, grid, **kw):
        if (step.shape.tp_size, batch, context) == (2, 2, 32):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(step, buffer, batch, context, grid, **kw)

    monkeypatch.setattr(gpu, "_measure_point", measure)
    grid = GpuGrid(tps=(1, 2), batches=(1, 2), contexts=(8, 16, 32), warmup=1, repeats=1, steps_per_repeat=1)
    (path,) = run(["tiny_llama"], grid, device_name="cpu", dtype_name="float32", graph=False, max_seconds=600.0,
                  out_dir=tmp_path, tag="t", reserve_bytes=0.0, kv_limit_bytes=None, ar_variant="central")
    data, m = _load(path)
    assert data["meta"]["out_of_memory"] == {"2": [[2, 32]]} and data["meta"]["filled"] == [[2, 2, 32]]
    assert m.tps == (1, 2) and len(data["decode"]) == 12


def test_nothing_measured_writes_nothing(tmp_path: Path) -> None:
    grid = GpuGrid(tps=(1,), batches=(1,), contexts=(8,), warmup=1, repeats=1, steps_per_repeat=1)
    stale = tmp_path / "t_tiny_llama_measured.json"
    stale.write_text("{}")  # an earlier run's file is neither claimed nor replaced
    paths = run(["tiny_llama"], grid, device_name="cpu", dtype_name="float32", graph=False, max_seconds=0.0,
                out_dir=tmp_path, tag="t", reserve_bytes=0.0, kv_limit_bytes=None, ar_variant="central")
    assert paths == [] and list(tmp_path.iterdir()) == [stale] and stale.read_text() == "{}"


def _point(b: int, c: int, t: float) -> PointResult:
    return PointResult(batch=b, context=c, eager=(t, t, t), graph=None, wall_s=0.0)


def test_fill_grid_extrapolates_rows_and_drops_the_unfillable() -> None:
    grid = GpuGrid(tps=(1,), batches=(1, 2, 4, 8), contexts=(10, 20, 40))
    t = {1: {10: 1.0, 20: 1.5, 40: 2.5}, 2: {10: 2.0, 20: 3.0}, 4: {10: 4.0}}  # batch 8: nothing fits
    res = TpResult(tp=1, shape=rank_shape(MODELS["tiny_llama"][1], 1, max_tp=1), kv_budget_bytes=1.0,
                   points=[_point(b, c, v) for b, row in t.items() for c, v in row.items()],
                   skipped=[(2, 40), (4, 20), (4, 40), (8, 10), (8, 20), (8, 40)])
    values, batches, contexts = fill_grid(res, grid, "eager")
    assert batches == [1, 2, 4] and contexts == [10, 20, 40]
    assert values[(2, 40)] == pytest.approx(3.0 + 0.1 * 20)  # own slope: (3.0 - 2.0) / 10
    assert values[(4, 20)] == pytest.approx(4.0 + 0.2 * 10)  # batch 2's slope x 4/2
    assert values[(4, 40)] == pytest.approx(4.0 + 0.2 * 30)
    assert {k: v for k, v in values.items() if k[0] == 1} == {(1, c): v for c, v in t[1].items()}
    res.stopped_at = (2, 40)  # a budget stop in the last column keeps the first two
    values, batches, contexts = fill_grid(res, grid, "eager")
    assert contexts == [10, 20] and batches == [1, 2, 4] and values[(4, 20)] == pytest.approx(6.0)


def test_tp_efficiency_and_its_bracket() -> None:
    decode = [{"tp": 1, "batch": 64, "context": 128, "step_s": 0.010},
              {"tp": 2, "batch": 64, "context": 128, "step_s": 0.0060},  # 0.010 / (2 x 0.006) = 0.833
              {"tp": 8, "batch": 64, "context": 128, "step_s": 0.0040, "filled": FILLED},  # 0.3125
              {"tp": 4, "batch": 256, "context": 128, "step_s": 0.0010}]  # no TP1 point there: not compared
    rows = tp_efficiency(decode)
    assert rows == [{"tp": 2, "batch": 64, "context": 128, "eff": 0.8333, "bracket": "low-central", "filled": False},
                    {"tp": 8, "batch": 64, "context": 128, "eff": 0.3125, "bracket": "below low", "filled": True}]
    assert [bracket_of(4, x) for x in (0.49, 0.5, 0.7, 0.85, 0.86)] == \
        ["below low", "low-central", "central-high", "central-high", "above high"]


def test_budget_shares_follow_estimated_cost() -> None:
    now = [0.0]
    b = Budget.start(100.0, lambda: now[0])
    part = b.sub(own_cost=1.0, remaining_cost=4.0)
    assert part.deadline == 25.0 and part.allows(25.0) and not part.allows(25.1)
    now[0] = 10.0  # the part used 10 of its 25: the next gets its share of the 90 left
    assert b.sub(own_cost=3.0, remaining_cost=3.0).deadline == 100.0
    assert b.sub(own_cost=1.0, remaining_cost=0.0).deadline == 100.0


def test_default_h200_run_fits_eight_minutes() -> None:
    grid = GpuGrid()
    assert (grid.tps, grid.batches[0], grid.batches[-1], grid.contexts[0], grid.contexts[-1]) == \
        (DEFAULT_TPS, 1, 512, 128, 16384) and (DEFAULT_BATCHES, DEFAULT_CONTEXTS) == (grid.batches, grid.contexts)
    models = ["llama31_8b", "qwen3_14b"]
    budgets = {(m, tp): kv_budget_bytes(GPUS["h200"][1] - rank_shape(MODELS[m][1], tp, max_tp=8).weight_bytes, 6e9)
               for m in models for tp in grid.tps}
    assert estimate_run_s(models, grid, kv_budget=budgets) < 420
    llama1 = rank_shape(MODELS["llama31_8b"][1], 1, max_tp=8)
    assert not fits(MODELS["llama31_8b"][1], llama1, 512, 16384, budgets[("llama31_8b", 1)])  # 1 TiB of KV
    assert fits(MODELS["llama31_8b"][1], llama1, 32, 16384, budgets[("llama31_8b", 1)])
    # The documented command: --max-seconds 420 for the measuring, start-up on top, inside `timeout 480`.
    doc = (ROOT / "pat_rollout/profile/gpu.py").read_text()
    assert "timeout 480 python3 -m pat_rollout.profile.gpu" in doc and "--max-seconds 420" in doc
    assert 420 + EST_START_S <= 480
    assert "python3 -m pat_rollout.profile.gpu" in (ROOT / "README.md").read_text()
    assert allreduce_s(MODELS["llama31_8b"][1], 1) == 0.0
    assert allreduce_s(MODELS["llama31_8b"][1], 8) == pytest.approx(66 * 11e-6)


@pytest.mark.parametrize("module,banned", [("pat_rollout.profile.gpu", ("sglang", "ray")),
                                            ("pat_rollout.profile.gpu_plan", ("torch", "sglang", "ray")),
                                            ("pat_rollout.profile.gpu_profile", ("torch", "sglang", "ray")),
                                            ("pat_rollout.profile.gpu_step", ("sglang", "ray"))])
def test_imports(module: str, banned: tuple[str, ...]) -> None:
    code = f"import sys, {module}\nbad = sorted(set({banned!r}) & set(sys.modules))\nassert not bad, bad\n"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
