from __future__ import annotations

import copy
import json

import pytest

from pat_rollout.profile.model import BUILTIN_PROFILES, DATA_DIR, LatencyModel
from pat_rollout.profile.published import all_published


@pytest.fixture(scope="module")
def h100() -> LatencyModel:
    return LatencyModel.from_json("h100_llama31_8b")


def _tiny() -> dict:
    return {
        "schema_version": 1,
        "meta": {"hardware": "x", "model": "m", "backend": "b", "source": "measured", "notes": ""},
        "model": {"num_layers": 2, "hidden_size": 8, "num_heads": 2, "num_kv_heads": 1, "head_dim": 4,
                  "param_bytes": 1000, "dtype_bytes": 4},
        "decode": [{"tp": 1, "batch": b, "context": c, "step_s": s}
                   for (b, c, s) in [(1, 10, 1.0), (1, 20, 2.0), (3, 10, 3.0), (3, 20, 5.0)]],
        "prefill": [{"tp": 1, "tokens_per_s": 100.0, "fixed_s": 0.5}],
        "kv_transfer": {"bandwidth_bytes_per_s": 10.0, "latency_s": 0.1},
        "reshard": {"bandwidth_bytes_per_s": 20.0, "fixed_s": 0.2},
        "group_switch_s": 0.3,
    }


def test_shipped_profiles_are_published_figures_and_regenerable() -> None:
    published = all_published()
    for name, fname in BUILTIN_PROFILES.items():
        data = json.loads((DATA_DIR / fname).read_text())
        assert data == published[fname.removesuffix(".json")]
        assert data["meta"]["source"] == "published-figures"
        assert "NOT MEASURED" in data["meta"]["notes"] and "1008" in data["meta"]["sources"]["anchors"]


def test_exact_at_grid_points(h100: LatencyModel) -> None:
    data = json.loads((DATA_DIR / BUILTIN_PROFILES["h100_llama31_8b"]).read_text())
    for p in data["decode"]:
        assert h100.decode_step_s(p["tp"], p["batch"], p["context"]) == pytest.approx(p["step_s"], rel=1e-12)


def test_calibration_anchors(h100: LatencyModel) -> None:
    # SGLang Llama-3-8B batch-1 decode on H100 (sglang issue #1008)
    assert h100.decode_step_s(1, 1, 130) == pytest.approx(7.37e-3, rel=0.01)
    assert h100.decode_step_s(8, 1, 130) == pytest.approx(3.35e-3, rel=0.01)


def test_bilinear_between_points_and_extrapolation() -> None:
    m = LatencyModel.from_dict(_tiny())
    assert m.decode_step_s(1, 2, 15) == pytest.approx((1 + 2 + 3 + 5) / 4)
    assert m.decode_step_s(1, 1, 5) == 1.0  # clamped below
    assert m.decode_step_s(1, 5, 10) == pytest.approx(5.0)  # slope 1 per batch past the grid
    assert m.decode_step_s(1, 0, 10) == 0.0
    assert m.prefill_s(1, 100) == pytest.approx(1.5)
    assert m.kv_migrate_s(10) == pytest.approx(1.1) and m.kv_migrate_s(0) == 0.0
    assert m.reshard_s(20) == pytest.approx(1.2)
    assert LatencyModel.from_dict(m.to_dict()).to_dict() == m.to_dict()


def test_monotone_in_batch_and_context(h100: LatencyModel) -> None:
    for tp in h100.tps:
        for c in (100, 700, 3000, 20000, 50000):
            ys = [h100.decode_step_s(tp, b, c) for b in range(1, 1500, 37)]
            assert ys == sorted(ys)
        for b in (1, 7, 100, 2000):
            ys = [h100.decode_step_s(tp, b, c) for c in range(1, 40000, 997)]
            assert ys == sorted(ys)


def test_small_tp_wins_at_large_batch_large_tp_at_small(h100: LatencyModel) -> None:
    tput = {tp: (8 // tp) * (1024 // (8 // tp)) / h100.decode_step_s(tp, 1024 // (8 // tp), 2048) for tp in h100.tps}
    assert tput[2] > tput[8] and tput[1] > tput[8]
    assert h100.decode_step_s(8, 1, 4096) < h100.decode_step_s(1, 1, 4096) / 2


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.update(schema_version=2), "schema_version=2"),
    (lambda d: d.pop("kv_transfer"), "kv_transfer is missing"),
    (lambda d: d["model"].pop("num_kv_heads"), "model.num_kv_heads is missing"),
    (lambda d: d["meta"].update(source="guessed"), "meta.source"),
    (lambda d: d["decode"].pop(), "not rectangular"),
    (lambda d: d["decode"][0].update(step_s="fast"), r"decode\[0\].step_s"),
    (lambda d: d["prefill"][0].update(tp=2), "prefill tps"),
    (lambda d: d["reshard"].update(bandwidth_bytes_per_s=0), "reshard.bandwidth_bytes_per_s=0.0"),
    (lambda d: d["decode"][1].update(step_s_range=[0.2, 0.1]), r"decode\[1\].step_s_range=\[0.2, 0.1\]"),
    (lambda d: d["decode"][1].update(step_s_range=[0.1]), r"decode\[1\].step_s_range"),
])
def test_bad_profiles_name_the_field(mutate, match) -> None:
    d = copy.deepcopy(_tiny())
    mutate(d)
    with pytest.raises(ValueError, match=match):
        LatencyModel.from_dict(d)


def test_bad_file_and_unknown_tp(tmp_path, h100: LatencyModel) -> None:
    p = tmp_path / "p.json"
    p.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        LatencyModel.from_json(p)
    with pytest.raises(ValueError, match=r"tp=3 is not in the profile"):
        h100.decode_step_s(3, 1, 1)


def test_measured_cpu_profile_records_its_spread_and_machine() -> None:
    """The shipped CPU profile was measured as the pool runs (all replicas at once, repeated): every point has its
    spread, which brackets it, and the meta says on what machine."""
    d = json.loads((DATA_DIR / "cpu_ref_llama_demo.json").read_text())
    assert d["meta"]["source"] == "measured" and "Xeon" in d["meta"]["hardware"] and "at once" in d["meta"]["notes"]
    assert all(p["step_s_range"][0] <= p["step_s"] <= p["step_s_range"][1] for p in d["decode"])
    assert LatencyModel.from_dict(d).tps == (1, 2)
