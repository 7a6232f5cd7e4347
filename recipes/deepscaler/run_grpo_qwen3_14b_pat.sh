#!/usr/bin/env bash
# GRPO, Qwen3-14B, DeepScaleR, 8 GPUs, PAT rollout (TP regrouped during generation).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3-14B}
rollout_args pat "${PAT_INITIAL_TP:-1}"
launch "${COMMON_ARGS[@]}" \
    "algorithm.adv_estimator=grpo" \
    "algorithm.use_kl_in_reward=False" \
    "actor_rollout_ref.model.path=$MODEL_PATH" \
    "actor_rollout_ref.actor.use_kl_loss=True" \
    "actor_rollout_ref.actor.kl_loss_coef=0.001" \
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl" \
    "actor_rollout_ref.actor.fsdp_config.param_offload=True" \
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True" \
    "${ROLLOUT_ARGS[@]}" \
    "trainer.experiment_name=${EXPERIMENT_NAME:-grpo_qwen3_14b_pat}" \
    "$@"
