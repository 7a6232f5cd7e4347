#!/usr/bin/env bash
# GRPO, Qwen3-14B, DeepScaleR, 8 GPUs, PAT rollout (TP regrouped during generation);
# POLICY=static: the static-TP baseline (TP=${STATIC_TP:-4}), same engine and settings.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3-14B}
policy_args grpo_qwen3_14b 4
launch "${COMMON_ARGS[@]}" "${GRPO_ARGS[@]}" \
    "actor_rollout_ref.model.path=$MODEL_PATH" \
    "actor_rollout_ref.actor.fsdp_config.param_offload=True" \
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True" \
    "${ROLLOUT_ARGS[@]}" \
    "trainer.experiment_name=$RUN_NAME" \
    "$@"
