#!/usr/bin/env bash
# GRPO, Llama-3.1-8B-Instruct, DeepScaleR, 8 GPUs, PAT rollout (TP regrouped during generation);
# POLICY=static: the static-TP baseline (TP=${STATIC_TP:-2}), same engine and settings.
# Extra Hydra overrides can be appended: bash run_grpo_llama31_8b.sh trainer.total_training_steps=100
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
MODEL_PATH=${MODEL_PATH:-meta-llama/Llama-3.1-8B-Instruct}
policy_args grpo_llama31_8b 2
launch "${COMMON_ARGS[@]}" "${GRPO_ARGS[@]}" \
    "actor_rollout_ref.model.path=$MODEL_PATH" \
    "${ROLLOUT_ARGS[@]}" \
    "trainer.experiment_name=$RUN_NAME" \
    "$@"
