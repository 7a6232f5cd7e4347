#!/usr/bin/env bash
# The CPU example launched as a Ray job: start a private local Ray head (own temp dir, free ports, fake GPUs),
# `ray job submit` the same main_ppo command as run.sh (runtime_env: working_dir = this checkout, env_vars = the
# CPU platform's), wait for the job, stop the head. Only the head started here is stopped: it runs in its own
# session and is ended by killing that session's process group (never `ray stop`, which ends every Ray instance
# on the machine).
#
#   bash examples/grpo_cpu/submit.sh                    # GRPO, legacy trainer, 2 actors
#   TRAINER=v1 bash examples/grpo_cpu/submit.sh trainer.total_training_steps=2
#
# The knobs of run.sh apply (WORK_DIR, PYTHON, ALGO, KL, TRAINER, NUM_ACTORS, STEPS, WANDB, PAT_POLICY).
# Ray auth: `ray start` and `ray job submit` must agree (else "Missing authentication token"); both run with
# RAY_AUTH_MODE=disabled here unless you export another mode.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
[[ -x "$REPO/.venv/bin/python" ]] && DEFAULT_PYTHON=$REPO/.venv/bin/python || DEFAULT_PYTHON=python3
export PYTHON=${PYTHON:-$DEFAULT_PYTHON}
export WORK_DIR=${WORK_DIR:-/tmp/pat_grpo_cpu}
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled} RAY_USAGE_STATS_ENABLED=0
NUM_ACTORS=${NUM_ACTORS:-2}
RAY_BIN=$(dirname "$("$PYTHON" -c "import sys; print(sys.executable)")")/ray
HEAD_TMP=$(mktemp -d /tmp/pat_ray_head.XXXXXX)   # short: Ray's socket paths must fit 107 bytes
read -r GCS_PORT DASH_PORT CLIENT_PORT AGENT_PORT < <("$PYTHON" - <<'EOF'
import socket
socks = [socket.socket() for _ in range(4)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
EOF
)

HEAD_PID=
stop_head() {
    if [[ -n "$HEAD_PID" ]]; then
        kill -TERM -- "-$HEAD_PID" 2>/dev/null || true
        for _ in $(seq 15); do kill -0 -- "-$HEAD_PID" 2>/dev/null || break; sleep 1; done
        kill -KILL -- "-$HEAD_PID" 2>/dev/null || true
    fi
    rm -rf "$HEAD_TMP"
}
trap stop_head EXIT

# setsid: the head (and every process it starts) in a session of its own, whose process group stop_head ends.
env -u RAY_ADDRESS setsid "$RAY_BIN" start --head --block --temp-dir="$HEAD_TMP" --node-ip-address=127.0.0.1 \
    --port="$GCS_PORT" --dashboard-host=127.0.0.1 --dashboard-port="$DASH_PORT" \
    --ray-client-server-port="$CLIENT_PORT" --dashboard-agent-listen-port="$AGENT_PORT" \
    --num-cpus=32 --num-gpus="$NUM_ACTORS" --disable-usage-stats > "$HEAD_TMP/head.log" 2>&1 &
HEAD_PID=$!
disown "$HEAD_PID"   # stop_head reaps it; no job-status noise from bash
export RAY_ADDRESS=http://127.0.0.1:$DASH_PORT
for _ in $(seq 120); do
    "$RAY_BIN" job list >/dev/null 2>&1 && break
    kill -0 "$HEAD_PID" 2>/dev/null || { cat "$HEAD_TMP/head.log" >&2; echo "ray head failed to start" >&2; exit 1; }
    sleep 1
done
echo "ray head up at $RAY_ADDRESS (temp dir $HEAD_TMP)"
LAUNCH=submit bash "$HERE/run.sh" "$@"
