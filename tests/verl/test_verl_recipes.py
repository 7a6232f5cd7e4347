"""DeepScaleR recipes: scripts parse, every override composes against verl's config, data prep and reward work."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.verl

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "deepscaler"
SCRIPTS = sorted(RECIPE.glob("run_*.sh"))


def overrides_of(script: Path, **env: str) -> list[str]:
    proc = subprocess.run(["bash", str(script)], env={**os.environ, "PRINT_OVERRIDES": "1", **env},
                          capture_output=True, text=True, timeout=30, check=True)
    return proc.stdout.splitlines()


RECIPES = ("grpo_llama31_8b", "grpo_qwen3_14b", "ppo_llama31_8b")


def test_expected_scripts_exist():
    assert {s.name for s in SCRIPTS} == {f"run_{base}.sh" for base in RECIPES}


@pytest.mark.parametrize("script", SCRIPTS + [RECIPE / "common.sh"], ids=lambda p: p.name)
def test_bash_syntax(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.parametrize("policy", ["pat", "static"])
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_overrides_compose_and_pat_config_is_valid(script, policy, tmp_path):
    pytest.importorskip("verl")
    from verl.utils.config import omega_conf_to_dataclass
    from verl_helpers import compose_ppo

    from pat_rollout.verl.config import from_verl

    overrides = overrides_of(script, DATA_DIR=str(tmp_path), POLICY=policy)
    cfg = compose_ppo(overrides)
    rc = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    pat = from_verl(rc, cfg.actor_rollout_ref.model.path, check_model=False)
    assert rc.name == "pat" and rc.n == 8 and rc.response_length == 16384 and pat.num_devices == 8
    assert pat.backend == "sglang"
    assert cfg.reward.custom_reward_function.path == "recipes/deepscaler/deepscaler_reward.py"
    assert (RECIPE / "deepscaler_reward.py").exists()
    if policy == "static":
        assert pat.policy == "static" and len(pat.tp_sizes) == 1
    else:
        assert pat.policy == "pat" and pat.tp_sizes == (1, 2, 4, 8)


@pytest.mark.parametrize("base", RECIPES)
def test_pat_and_static_differ_only_in_rollout_policy(base):
    pat = overrides_of(RECIPE / f"run_{base}.sh")
    static = overrides_of(RECIPE / f"run_{base}.sh", POLICY="static")
    differ = sorted(set(pat) ^ set(static))
    assert differ and all(".pat.policy=" in o or ".pat.initial_tp=" in o or "experiment_name=" in o
                          for o in differ), differ
    assert f"trainer.experiment_name={base}_pat" in pat and any(o.startswith(
        f"trainer.experiment_name={base}_static_tp") for o in static)


def test_an_unknown_policy_is_refused():
    proc = subprocess.run(["bash", str(SCRIPTS[0])], env={**os.environ, "PRINT_OVERRIDES": "1", "POLICY": "dynamic"},
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "POLICY=dynamic must be pat or static" in proc.stderr


def test_prepare_data_on_synthetic_sample(tmp_path):
    import sys

    pd = pytest.importorskip("pandas")
    sys.path.insert(0, str(RECIPE))
    try:
        import prepare_data
    finally:
        sys.path.remove(str(RECIPE))
    items = [{"problem": f"What is {i} + {i}?", "answer": str(2 * i), "solution": f"{i}+{i}={2 * i}"}
             for i in range(10)]
    src = tmp_path / "deepscaler.json"
    src.write_text(json.dumps(items))
    paths = prepare_data.convert(src, tmp_path / "out", val_size=3)
    train, val = pd.read_parquet(paths["train"]), pd.read_parquet(paths["val"])
    assert (len(train), len(val)) == (7, 3)
    row = train.iloc[0]
    assert row["data_source"] == "deepscaler" and row["ability"] == "math"
    assert list(row["prompt"][0].keys()) == ["role", "content"] and row["prompt"][0]["role"] == "user"
    assert "\\boxed{}" in row["prompt"][0]["content"]
    assert row["reward_model"]["style"] == "rule"
    i = row["extra_info"]["index"]
    assert row["reward_model"]["ground_truth"] == str(2 * i) and row["extra_info"]["split"] == "train"
    assert sorted(train["extra_info"].map(lambda e: e["index"]).tolist() + val["extra_info"].map(
        lambda e: e["index"]).tolist()) == list(range(10))
    with pytest.raises(ValueError, match="problem"):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps([{"question": "x"}]))
        prepare_data.convert(bad, tmp_path / "bad")


@pytest.mark.parametrize(
    ("response", "truth", "score"),
    [
        ("<think>2+2</think> The answer is \\boxed{4}.", "4", 1.0),
        ("so x = \\boxed{\\dfrac{1}{2}}", "\\frac12", 1.0),
        ("\\boxed{0.5}", "1/2", 1.0),
        ("\\boxed{x = 12}", "12", 1.0),
        ("\\boxed{1,000}", "1000", 1.0),
        ("\\boxed{\\text{(B)}}", "(B)", 1.0),
        ("first \\boxed{3} then \\boxed{5}", "5", 1.0),
        ("\\boxed{\\frac{3}{4}}", ["0.75", "3/4"], 1.0),
        ("\\boxed{5}", "6", 0.1),
        ("<think>\\boxed{4}</think> no box after thinking", "4", 0.0),
        ("the answer is 4", "4", 0.0),
        ("\\boxed{\\sqrt{2}}", "\\sqrt2", 0.1),
    ],
)
def test_reward(response, truth, score):
    import sys

    sys.path.insert(0, str(RECIPE))
    try:
        from deepscaler_reward import compute_score
    finally:
        sys.path.remove(str(RECIPE))
    out = compute_score("deepscaler", response, truth)
    assert out["score"] == pytest.approx(score), out
