"""verl's own trainer end to end on CPU with PAT on real vLLM engines: `python -m verl.trainer.main_ppo` with
`rollout.name=pat` and `engine_kwargs.pat.backend=vllm`, launched by `examples/grpo_cpu/run.sh` as a user would
(`PAT_BACKEND=vllm`: the tiny random Llama widened to head_dim 32, vLLM's CPU minimum). Legacy trainer, GRPO, 2
actors (one pool of 2 devices, 2 x TP1 <-> 1 x TP2), 2 steps.

Asserts exit 0, steps 1-2 logged with a finite policy loss, PAT switching inside every rollout stage to 1 x TP2
on vLLM engines (`pat/num_reconfigs >= 1`, no failed switch, the stage ending in TP2), the weights loaded in the
base layout, and verl's rollout-vs-trainer log-prob agreement (vLLM's CPU kernels vs FSDP2, both fp32): a weight
update that did not reach every vLLM engine (`VllmPool.update_weights` reloads them from the pool's checkpoint)
moves it by orders of magnitude. Runs in the vLLM venv (`make test-vllm`; `make install-vllm` puts verl there).
"""

from __future__ import annotations

import math
import re

import pytest

pytest.importorskip("vllm")
pytest.importorskip("verl", reason="verl is not in this vLLM venv (make install-vllm installs it)")
from e2e_helpers import run_example  # noqa: E402

pytestmark = [pytest.mark.verl, pytest.mark.verl_e2e, pytest.mark.slow, pytest.mark.ray]

STEPS = 2
RUN_TIMEOUT_S = 840  # each vLLM engine start is 15-50 s here; a stage switches 2 x TP1 -> 1 x TP2 -> 2 x TP1
PAT = "timing_s/pat/"
PROBS_DIFF_MAX = 1e-4
PEARSON_MIN = 0.9999


def test_grpo_legacy_2actors_on_vllm(tmp_path):
    run = run_example(tmp_path, RUN_TIMEOUT_S, ALGO="grpo", TRAINER="legacy", NUM_ACTORS="2", STEPS=str(STEPS),
                      PAT_BACKEND="vllm")
    assert run.returncode == 0, run.tail()
    # vLLM engine cores served it, restarted per layout: 2 x TP1 at start-up, then per step a TP2 engine and,
    # before the next weight update, 2 x TP1 again (each engine core logs its pid on vLLM's warnings)
    cores = set(re.findall(r"\(EngineCore pid=(\d+)\)", run.log))
    assert len(cores) >= 2 + STEPS, sorted(cores)
    assert sorted(run.steps) == list(range(1, STEPS + 1)), (sorted(run.steps), run.tail())
    for step, m in sorted(run.steps.items()):
        where = f"step {step}"
        assert math.isfinite(m["actor/pg_loss"]), (where, m["actor/pg_loss"])
        assert m[PAT + "num_reconfigs"] >= 1, (where, {k: v for k, v in m.items() if PAT in k})
        assert m[PAT + "num_failed_reconfigs"] == 0, where
        assert m[PAT + "stage_end_tp"] == 2, (where, m[PAT + "stage_end_tp"])
        assert m[PAT + "weight_sync_tp"] == 1, (where, m[PAT + "weight_sync_tp"])
        assert m["training/rollout_probs_diff_valid"] == 1, where
        assert m["training/rollout_probs_diff_max"] < PROBS_DIFF_MAX, (where, m["training/rollout_probs_diff_max"])
        assert m["training/rollout_actor_probs_pearson_corr"] > PEARSON_MIN, where
