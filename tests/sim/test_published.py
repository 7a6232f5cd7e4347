"""Published-figure profiles: every figure has a source, anchors reproduce, the bracket holds."""

from __future__ import annotations

import json

import pytest

from pat_rollout.profile.model import DATA_DIR, LatencyModel
from pat_rollout.profile.published import EFF, VARIANTS, all_published, check_bracket, gpu_step_model

FIGURES = ("hbm_bytes_per_s", "hbm_bytes", "anchors", "hbm_eff", "fixed_step_s", "comp1_s", "ar_latency_s", "eff",
           "model_shape", "mem_fraction", "prefill")


@pytest.mark.parametrize("name", sorted(all_published()))
def test_each_figure_has_a_source_and_file_is_regenerable(name: str) -> None:
    data = json.loads((DATA_DIR / f"{name}.json").read_text())
    assert data == all_published()[name]
    sources = data["meta"]["sources"]
    assert set(FIGURES) <= set(sources), sorted(set(FIGURES) - set(sources))
    assert all(isinstance(v, str) and v for v in sources.values())
    assert set(data["meta"]["assumed"]) >= {"activation_reserve_bytes", "group_switch_s"}  # said to be assumed
    m = LatencyModel.from_dict(data)
    assert m.meta["variant"] in VARIANTS and m.memory["mem_fraction"] == 0.6


@pytest.mark.parametrize("variant", VARIANTS)
def test_anchors_and_bracket(variant: str) -> None:
    m = gpu_step_model("h100", "llama31_8b", variant)
    assert m.decode_step_s(1, 1, 130) == pytest.approx(7.37e-3, rel=1e-9)
    assert m.decode_step_s(8, 1, 130) == pytest.approx(3.35e-3, rel=1e-9)
    assert m.decode_step_s(1, 128, 130) == pytest.approx(11.84e-3, rel=1e-9)
    rel = check_bracket(m, batch=1 << 16)  # the variant's eff is the high-concurrency limit
    for tp, eff in EFF[variant].items():
        assert rel[tp] == pytest.approx(eff, rel=0.01)


def test_qwen_is_its_own_shape_and_h200_is_faster() -> None:
    q, ll = gpu_step_model("h100", "qwen3_14b", "central"), gpu_step_model("h100", "llama31_8b", "central")
    assert q.shape.num_layers == 40 and q.shape.kv_bytes_per_token() == 160 * 1024
    assert q.decode_step_s(1, 64, 1024) > ll.decode_step_s(1, 64, 1024)
    h200 = gpu_step_model("h200", "llama31_8b", "central")
    assert h200.decode_step_s(1, 64, 4096) < ll.decode_step_s(1, 64, 4096)
