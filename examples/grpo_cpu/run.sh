#!/usr/bin/env bash
# verl's own trainer (python -m verl.trainer.main_ppo) with rollout.name=pat on a CPU-only host: a tiny random
# Llama, a small arithmetic dataset, a rule-based reward, N Ray actors standing in for GPUs. See README.md.
#
#   bash examples/grpo_cpu/run.sh                       # GRPO, legacy trainer, 2 actors, 3 steps
#   ALGO=ppo bash examples/grpo_cpu/run.sh              # PPO: GAE + a critic
#   KL=1 bash examples/grpo_cpu/run.sh                  # + reference policy and KL loss
#   TRAINER=v1 NUM_ACTORS=4 bash examples/grpo_cpu/run.sh
#   WANDB=1 bash examples/grpo_cpu/run.sh               # + wandb, offline, under $WORK_DIR/wandb
#   PAT_BACKEND=vllm PYTHON=.venv-vllm/bin/python bash examples/grpo_cpu/run.sh   # PAT on vLLM engines
#   bash examples/grpo_cpu/run.sh trainer.total_training_steps=5   # extra Hydra overrides go last
#
# Knobs (env): WORK_DIR (assets, logs, checkpoints; default /tmp/pat_grpo_cpu), PYTHON, ALGO=grpo|ppo, KL=0|1,
# TRAINER=legacy|v1, NUM_ACTORS=2|4 (one PAT pool of that many devices, TP 1..NUM_ACTORS), STEPS, WANDB=0|1,
# PAT_POLICY=pat|static (static: never reconfigure, the baseline), PAT_BACKEND=reference|vllm (vllm: the vLLM venv
# of `make install-vllm`, a model with head_dim 32, model_hd32/), LAUNCH=local|submit (submit: `ray job submit`
# to RAY_ADDRESS, see submit.sh), PRINT_OVERRIDES=1 (print the Hydra overrides and exit).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
# the project's venv (`make install`) if there is one
[[ -x "$REPO/.venv/bin/python" ]] && DEFAULT_PYTHON=$REPO/.venv/bin/python || DEFAULT_PYTHON=python3
PYTHON=${PYTHON:-$DEFAULT_PYTHON}
WORK_DIR=${WORK_DIR:-/tmp/pat_grpo_cpu}
ALGO=${ALGO:-grpo}
KL=${KL:-0}
TRAINER=${TRAINER:-legacy}
NUM_ACTORS=${NUM_ACTORS:-2}
STEPS=${STEPS:-3}
WANDB=${WANDB:-0}
PAT_POLICY=${PAT_POLICY:-pat}
PAT_BACKEND=${PAT_BACKEND:-reference}
LAUNCH=${LAUNCH:-local}
case "$PAT_BACKEND" in  # vLLM's CPU attention needs head_dim >= 32 (the tiny preset's is 16)
    reference) HEAD_DIM_ARGS=(); MODEL=$WORK_DIR/model; SUFFIX= ;;
    vllm) HEAD_DIM_ARGS=(--head-dim 32); MODEL=$WORK_DIR/model_hd32; SUFFIX=_vllm ;;
    *) echo "PAT_BACKEND=$PAT_BACKEND: expected reference or vllm" >&2; exit 2 ;;
esac
EXPERIMENT=${EXPERIMENT:-${ALGO}_${TRAINER}_${NUM_ACTORS}actors$SUFFIX}

case "$ALGO" in grpo) ADV=grpo ;; ppo) ADV=gae ;; *) echo "ALGO=$ALGO: expected grpo or ppo" >&2; exit 2 ;; esac
case "$TRAINER" in legacy) USE_V1=false ;; v1) USE_V1=true ;; *) echo "TRAINER=$TRAINER: expected legacy or v1" >&2; exit 2 ;; esac
[[ "$KL" == 1 ]] && USE_KL=true || USE_KL=false
CANDIDATE_TPS=$("$PYTHON" -c "n=$NUM_ACTORS; print('[' + ','.join(str(t) for t in (1, 2, 4, 8) if n % t == 0 and t <= n) + ']')")

# The CPU platform for verl (pat_rollout/verl/cpu_platform.py; installed by pat_rollout's verl.plugins entry
# point when VERL_PLATFORM=cpu) and what every process of the run inherits.
export VERL_PLATFORM=cpu
export TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HYDRA_FULL_ERROR=1
export RAY_USAGE_STATS_ENABLED=0
export VERL_FILE_LOGGER_PATH=$WORK_DIR/$EXPERIMENT/metrics.jsonl   # trainer.logger `file`: one JSON line per step
LOGGERS=console,file
if [[ "$WANDB" == 1 ]]; then
    LOGGERS=console,file,wandb
    export WANDB_MODE=offline WANDB_DIR=$WORK_DIR/$EXPERIMENT WANDB_SILENT=true
fi

ARGS=(
    "algorithm.adv_estimator=$ADV"
    "algorithm.use_kl_in_reward=false"
    "data.train_files=$WORK_DIR/data/train.parquet"
    "data.val_files=$WORK_DIR/data/val.parquet"
    "data.train_batch_size=4"
    "data.val_batch_size=4"
    "data.max_prompt_length=64"
    "data.max_response_length=32"
    "data.filter_overlong_prompts=false"
    "data.truncation=error"
    "data.dataloader_num_workers=0"
    "actor_rollout_ref.model.path=$MODEL"
    # CPU: no flash-attention kernels, no unpadded (varlen) attention
    "actor_rollout_ref.model.use_remove_padding=false"
    "+actor_rollout_ref.model.override_config.attn_implementation=sdpa"
    # FSDP2 only: verl's FSDP1 path refuses CPU parameters (see cpu_platform.py). fp32 compute: verl's default
    # bf16 autocast is slow on most CPUs, and in fp32 the trainer's log-probs match the rollout's to ~1e-6.
    "actor_rollout_ref.actor.strategy=fsdp2"
    "actor_rollout_ref.ref.strategy=fsdp2"
    "critic.strategy=fsdp2"
    "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32"
    "+actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=fp32"
    "+critic.fsdp.mixed_precision.param_dtype=fp32"
    "critic.model.path=$MODEL"
    "critic.model.use_remove_padding=false"
    "+critic.model.override_config.attn_implementation=sdpa"
    "critic.ppo_micro_batch_size_per_gpu=2"
    "critic.optim.lr=1e-4"
    "actor_rollout_ref.actor.ppo_mini_batch_size=4"
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"
    "actor_rollout_ref.actor.use_dynamic_bsz=false"
    "actor_rollout_ref.actor.optim.lr=1e-4"
    "actor_rollout_ref.actor.use_kl_loss=$USE_KL"
    "actor_rollout_ref.actor.kl_loss_coef=0.01"
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl"
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2"
    # The rollout: one PAT pool of NUM_ACTORS devices (tp * dp = NUM_ACTORS), reference engine on Ray actors.
    "actor_rollout_ref.rollout.name=pat"
    "actor_rollout_ref.rollout.mode=async"
    "actor_rollout_ref.rollout.n=2"
    "actor_rollout_ref.rollout.tensor_model_parallel_size=$NUM_ACTORS"
    "actor_rollout_ref.rollout.data_parallel_size=1"
    "actor_rollout_ref.rollout.dtype=float32"
    "actor_rollout_ref.rollout.prompt_length=64"
    "actor_rollout_ref.rollout.response_length=32"
    "actor_rollout_ref.rollout.calculate_log_probs=true"
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2"
    "actor_rollout_ref.rollout.agent.num_workers=1"
    "+actor_rollout_ref.rollout.agent.agent_loop_manager_class=pat_rollout.verl.agent_loop.PatAgentLoopManager"
    "+actor_rollout_ref.rollout.engine_kwargs.pat.backend=$PAT_BACKEND"
    "+actor_rollout_ref.rollout.engine_kwargs.pat.policy=$PAT_POLICY"
    "+actor_rollout_ref.rollout.engine_kwargs.pat.initial_tp=1"
    "+actor_rollout_ref.rollout.engine_kwargs.pat.candidate_tps=$CANDIDATE_TPS"
    # Make PAT switch mid-stage on CPU in every step (a demonstration setting, not a tuning): the builtin H100
    # profile predicts a gain from a larger TP; with no minimum gain, an evaluation every poll (8 decode steps),
    # no stage-start layout choice and no online calibration (which would learn that this CPU is no H100 and
    # stop switching, or start the stage in the larger layout) the planner switches mid-stage in every step.
    # The driver returns to the base layout (all TP=1) before each weight update and at the start of each stage.
    "+actor_rollout_ref.rollout.engine_kwargs.pat.profile_path=h100_llama31_8b"
    "+actor_rollout_ref.rollout.engine_kwargs.pat.steps_per_poll=8"
    "+actor_rollout_ref.rollout.engine_kwargs.pat.planner.eval_every_steps=8"
    "+actor_rollout_ref.rollout.engine_kwargs.pat.planner.min_gain_s=0.0"
    "+actor_rollout_ref.rollout.engine_kwargs.pat.planner.min_gain_ratio=0.0"
    "+actor_rollout_ref.rollout.engine_kwargs.pat.planner.start_layout=false"
    "+actor_rollout_ref.rollout.engine_kwargs.pat.planner.calibrate=false"
    # v1 trainer: PAT's stage metrics reach its logged metrics through this replay buffer (trainer_mode=sync)
    "trainer.v1.sampler.custom_sampler.path=pkg://pat_rollout.verl.replay_buffer"
    "trainer.v1.sampler.custom_sampler.name=PatReplayBuffer"
    # v1's TransferQueue: one storage unit (each one is a Ray actor; 2 cores)
    "transfer_queue.backend.SimpleStorage.num_data_storage_units=1"
    "reward.num_workers=1"
    "reward.custom_reward_function.path=$HERE/reward.py"
    "reward.custom_reward_function.name=compute_score"
    "trainer.device=cpu"
    "trainer.use_v1=$USE_V1"
    "trainer.n_gpus_per_node=$NUM_ACTORS"
    "trainer.nnodes=1"
    "trainer.critic_warmup=0"
    "trainer.total_training_steps=$STEPS"
    "trainer.total_epochs=1"
    "trainer.val_before_train=false"
    "trainer.test_freq=-1"
    "trainer.save_freq=-1"
    "trainer.logger=[$LOGGERS]"
    "trainer.project_name=pat_grpo_cpu"
    "trainer.experiment_name=$EXPERIMENT"
    "trainer.default_local_dir=$WORK_DIR/$EXPERIMENT/ckpt"
    "hydra.run.dir=$WORK_DIR/$EXPERIMENT/hydra"   # not ./outputs/ in the checkout
)
if [[ "$LAUNCH" == local ]]; then
    # A private local Ray instance: fake GPUs (one per actor) and enough logical CPUs for verl's actors
    # (v1's TransferQueue deadlocks silently when Ray's logical CPUs run out).
    ARGS+=("ray_kwargs.ray_init.num_cpus=32" "+ray_kwargs.ray_init.num_gpus=$NUM_ACTORS"
           "+ray_kwargs.ray_init.include_dashboard=false")
fi

if [[ "${PRINT_OVERRIDES:-0}" == 1 ]]; then
    printf '%s\n' "${ARGS[@]}" "$@"
    exit 0
fi

"$PYTHON" "$HERE/make_assets.py" --out "$WORK_DIR" ${HEAD_DIM_ARGS[@]+"${HEAD_DIM_ARGS[@]}"} >/dev/null
mkdir -p "$WORK_DIR/$EXPERIMENT"
cd "$REPO"
if [[ "$LAUNCH" == local ]]; then
    export RAY_TMPDIR=${RAY_TMPDIR:-$WORK_DIR/ray}   # own Ray session folder
    export RAY_ADDRESS=                              # never join another cluster
    mkdir -p "$RAY_TMPDIR"
    exec "$PYTHON" -m verl.trainer.main_ppo "${ARGS[@]}" "$@"
fi
# LAUNCH=submit: the job's processes get the environment from the runtime env, not from this shell.
RUNTIME_ENV=$("$PYTHON" - "$REPO" <<'EOF'
import json, os, sys
keys = ("VERL_PLATFORM", "TOKENIZERS_PARALLELISM", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "HYDRA_FULL_ERROR",
        "RAY_USAGE_STATS_ENABLED", "VERL_FILE_LOGGER_PATH", "WANDB_MODE", "WANDB_DIR", "WANDB_SILENT")
print(json.dumps({"working_dir": sys.argv[1],
                  "excludes": ["/.git/", "/.venv*/", "*.parquet", "*.safetensors", "/outputs/", "wandb/"],
                  "env_vars": {k: os.environ[k] for k in keys if k in os.environ}}))
EOF
)
PY_ABS=$("$PYTHON" -c "import sys; print(sys.executable)")   # the job runs on this machine's head: same Python
exec "$(dirname "$PY_ABS")/ray" job submit --address="${RAY_ADDRESS:?LAUNCH=submit needs RAY_ADDRESS, the dashboard URL of the head}" \
    --runtime-env-json="$RUNTIME_ENV" -- "$PY_ABS" -m verl.trainer.main_ppo "${ARGS[@]}" "$@"
