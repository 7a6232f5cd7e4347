#!/usr/bin/env bash
# Shared DeepScaleR settings for the PAT recipes and their static-TP baselines (sourced by run_*.sh).
# Every run_*.sh builds one Hydra override list from COMMON_ARGS + model/algorithm args + rollout args, so a PAT
# run and its baseline differ only in `engine_kwargs.pat.policy` / `initial_tp`.
#   PRINT_OVERRIDES=1 bash run_x.sh   prints the overrides (one per line) and exits: used by tests/verl.
set -euo pipefail

RECIPE_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DATA_DIR=${DATA_DIR:-$HOME/data/deepscaler}        # output of prepare_data.py
CKPT_DIR=${CKPT_DIR:-$HOME/checkpoints/deepscaler}
NNODES=${NNODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
RAY_ADDRESS=${RAY_ADDRESS:-http://127.0.0.1:8265}
# Must match how the cluster was started (`RAY_AUTH_MODE=disabled ray start --head`); see README.md.
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}

MAX_PROMPT_LEN=${MAX_PROMPT_LEN:-1024}
MAX_RESPONSE_LEN=${MAX_RESPONSE_LEN:-16384}
TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-128}
N_SAMPLES=${N_SAMPLES:-8}
TOTAL_EPOCHS=${TOTAL_EPOCHS:-1}
MAX_TOKEN_LEN_PER_GPU=$(( (MAX_PROMPT_LEN + MAX_RESPONSE_LEN) * 2 ))

COMMON_ARGS=(
    "data.train_files=$DATA_DIR/train.parquet"
    "data.val_files=$DATA_DIR/val.parquet"
    "data.train_batch_size=$TRAIN_BATCH_SIZE"
    "data.max_prompt_length=$MAX_PROMPT_LEN"
    "data.max_response_length=$MAX_RESPONSE_LEN"
    "data.filter_overlong_prompts=True"
    "data.truncation=error"
    "actor_rollout_ref.model.use_remove_padding=True"
    "actor_rollout_ref.model.enable_gradient_checkpointing=True"
    "actor_rollout_ref.actor.optim.lr=1e-6"
    "actor_rollout_ref.actor.ppo_mini_batch_size=64"
    "actor_rollout_ref.actor.use_dynamic_bsz=True"
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$MAX_TOKEN_LEN_PER_GPU"
    "actor_rollout_ref.actor.entropy_coeff=0"
    "actor_rollout_ref.actor.fsdp_config.param_offload=False"
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False"
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True"
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=$MAX_TOKEN_LEN_PER_GPU"
    "actor_rollout_ref.ref.fsdp_config.param_offload=True"
    "actor_rollout_ref.rollout.n=$N_SAMPLES"
    "actor_rollout_ref.rollout.temperature=0.6"
    "actor_rollout_ref.rollout.top_p=1.0"
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6"
    "actor_rollout_ref.rollout.max_num_seqs=512"
    "actor_rollout_ref.rollout.calculate_log_probs=True"
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True"
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=$MAX_TOKEN_LEN_PER_GPU"
    "actor_rollout_ref.rollout.val_kwargs.temperature=0.6"
    "actor_rollout_ref.rollout.val_kwargs.do_sample=True"
    "actor_rollout_ref.rollout.val_kwargs.n=1"
    "reward.custom_reward_function.path=recipes/deepscaler/deepscaler_reward.py"
    "reward.custom_reward_function.name=compute_score"
    "trainer.critic_warmup=0"
    # false: verl's legacy RayPPOTrainer; true: verl's default v1 trainer. PAT's stage metrics reach wandb as
    # timing_s/pat/* with both: PatAgentLoopManager (legacy) and PatReplayBuffer (v1; see README.md, Metrics).
    "trainer.use_v1=${VERL_USE_V1:-false}"
    "trainer.v1.sampler.custom_sampler.path=pkg://pat_rollout.verl.replay_buffer"
    "trainer.v1.sampler.custom_sampler.name=PatReplayBuffer"
    "trainer.logger=[console,wandb]"
    "trainer.project_name=pat_deepscaler"
    "trainer.nnodes=$NNODES"
    "trainer.n_gpus_per_node=$GPUS_PER_NODE"
    "trainer.save_freq=50"
    "trainer.test_freq=25"
    "trainer.total_epochs=$TOTAL_EPOCHS"
    "trainer.default_local_dir=$CKPT_DIR"
)

# GRPO's algorithm overrides (both GRPO recipes): group-relative advantages, KL as a loss term, not in the reward.
GRPO_ARGS=(
    "algorithm.adv_estimator=grpo"
    "algorithm.use_kl_in_reward=False"
    "actor_rollout_ref.actor.use_kl_loss=True"
    "actor_rollout_ref.actor.kl_loss_coef=0.001"
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl"
)

# rollout_args POLICY INITIAL_TP: the rollout section. One PAT pool per node (tp*dp = GPUS_PER_NODE devices);
# PAT starts with GPUS_PER_NODE/INITIAL_TP replicas and merges them (up to TP=8) as the batch drains.
# POLICY=static keeps INITIAL_TP for the whole stage: the static-TP baseline on the same engine.
rollout_args() {
    local policy=$1 initial_tp=$2
    ROLLOUT_ARGS=(
        "actor_rollout_ref.rollout.name=pat"
        "actor_rollout_ref.rollout.tensor_model_parallel_size=$GPUS_PER_NODE"
        "actor_rollout_ref.rollout.data_parallel_size=1"
        "+actor_rollout_ref.rollout.agent.agent_loop_manager_class=pat_rollout.verl.agent_loop.PatAgentLoopManager"
        "+actor_rollout_ref.rollout.engine_kwargs.pat.backend=${PAT_BACKEND:-sglang}"
        "+actor_rollout_ref.rollout.engine_kwargs.pat.policy=$policy"
        "+actor_rollout_ref.rollout.engine_kwargs.pat.initial_tp=$initial_tp"
        "+actor_rollout_ref.rollout.engine_kwargs.pat.candidate_tps=${PAT_CANDIDATE_TPS:-[1,2,4,8]}"
        "+actor_rollout_ref.rollout.engine_kwargs.pat.kv_handoff=${PAT_KV_HANDOFF:-auto}"
    )
}

# policy_args RECIPE DEFAULT_STATIC_TP: ROLLOUT_ARGS and RUN_NAME for POLICY (env, default pat): PAT from
# PAT_INITIAL_TP (default 1), or the static baseline at STATIC_TP (default DEFAULT_STATIC_TP). A recipe's PAT run and
# its baseline are the same script, so they differ only in these overrides and the experiment name.
policy_args() {
    local recipe=$1 static_tp=${STATIC_TP:-$2}
    case "${POLICY:-pat}" in
        pat) rollout_args pat "${PAT_INITIAL_TP:-1}"; RUN_NAME=${EXPERIMENT_NAME:-${recipe}_pat} ;;
        static) rollout_args static "$static_tp"; RUN_NAME=${EXPERIMENT_NAME:-${recipe}_static_tp${static_tp}} ;;
        *) echo "POLICY=${POLICY} must be pat or static" >&2; return 2 ;;
    esac
}

# launch ARGS...: submit `python3 -m verl.trainer.main_ppo ARGS...` as a Ray job (run from the repo root).
launch() {
    if [[ "${PRINT_OVERRIDES:-0}" == "1" ]]; then
        printf '%s\n' "$@"
        return 0
    fi
    cd "$RECIPE_DIR/../.."
    ray job submit --address="$RAY_ADDRESS" --runtime-env="recipes/deepscaler/runtime_env.yaml" --no-wait -- \
        python3 -m verl.trainer.main_ppo "$@"
}
