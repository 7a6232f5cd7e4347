#!/usr/bin/env bash
# PPO (GAE + critic), Llama-3.1-8B-Instruct, DeepScaleR, 8 GPUs, PAT rollout;
# POLICY=static: the static-TP baseline (TP=${STATIC_TP:-2}), same engine and settings.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
MODEL_PATH=${MODEL_PATH:-meta-llama/Llama-3.1-8B-Instruct}
CRITIC_PATH=${CRITIC_PATH:-$MODEL_PATH}
policy_args ppo_llama31_8b 2
launch "${COMMON_ARGS[@]}" \
    "algorithm.adv_estimator=gae" \
    "algorithm.use_kl_in_reward=False" \
    "actor_rollout_ref.model.path=$MODEL_PATH" \
    "actor_rollout_ref.actor.use_kl_loss=False" \
    "critic.optim.lr=1e-5" \
    "critic.model.path=$CRITIC_PATH" \
    "critic.model.use_remove_padding=True" \
    "critic.model.enable_gradient_checkpointing=True" \
    "critic.ppo_micro_batch_size_per_gpu=2" \
    "critic.use_dynamic_bsz=True" \
    "critic.ppo_max_token_len_per_gpu=$MAX_TOKEN_LEN_PER_GPU" \
    "critic.fsdp.param_offload=True" \
    "critic.fsdp.optimizer_offload=True" \
    "${ROLLOUT_ARGS[@]}" \
    "trainer.experiment_name=$RUN_NAME" \
    "$@"
