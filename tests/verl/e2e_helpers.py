"""Helpers of the end-to-end tests: run `examples/grpo_cpu/run.sh` (verl's real main_ppo) in its own process
group with a hard timeout, read the per-step metrics of verl's `file` logger, and read a wandb offline run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "grpo_cpu" / "run.sh"


@dataclass(frozen=True, kw_only=True, slots=True)
class Run:
    returncode: int
    log: str
    steps: dict[int, dict[str, float]]  # global step -> the metrics verl logged for it
    out_dir: Path                       # WORK_DIR/<experiment>

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.splitlines()[-n:])


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def run_example(work_dir: Path, timeout_s: float, **env: str) -> Run:
    """`bash examples/grpo_cpu/run.sh` with the knobs in `env` (ALGO, TRAINER, NUM_ACTORS, ...), in a new session.
    A run past `timeout_s` (a Ray resource deadlock is silent) gets SIGINT, then SIGKILL, and fails the test; the
    run's own process group is killed at the end in any case (stray Ray processes of this run only)."""
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    full_env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "VERL_USE_V1")}
    full_env.update(PYTHON=sys.executable, WORK_DIR=str(work_dir), RAY_TMPDIR=ray_tmp,
                    PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p), **env)
    experiment = subprocess.run(["bash", str(EXAMPLE)], env={**full_env, "PRINT_OVERRIDES": "1"}, check=True,
                                capture_output=True, text=True).stdout
    name = next(line.split("=", 1)[1] for line in experiment.splitlines() if line.startswith("trainer.experiment_name="))
    log_path = work_dir / f"{name}.log"
    work_dir.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["bash", str(EXAMPLE)], env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            rc = None
        finally:
            _kill_group(proc.pid, signal.SIGKILL)
            proc.wait()
            shutil.rmtree(ray_tmp, ignore_errors=True)
    text = log_path.read_text(errors="replace")
    if rc is None:
        pytest.fail(f"main_ppo ({env}) did not finish within {timeout_s}s (a Ray hang?); log {log_path}:\n"
                    + "\n".join(text.splitlines()[-60:]))
    out_dir = work_dir / name
    steps = read_metrics(out_dir / "metrics.jsonl") if (out_dir / "metrics.jsonl").exists() else {}
    return Run(returncode=rc, log=text, steps=steps, out_dir=out_dir)


def read_metrics(path: Path) -> dict[int, dict[str, float]]:
    """verl's `file` logger (VERL_FILE_LOGGER_PATH): one `{"step": s, "data": {...}}` line per logged step."""
    steps: dict[int, dict[str, float]] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        steps.setdefault(int(rec["step"]), {}).update(rec["data"])
    return steps


# wandb's transaction log (`run-<id>.wandb`): a LevelDB-style log of protobuf `Record`s, 32 KiB blocks, a 7-byte
# file header (":W&B", magic 0xBEE1, version) and a 7-byte header per chunk (crc32, length, type).
_BLOCK, _HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _wandb_records(data: bytes) -> Iterator[bytes]:
    ident, magic, _version = struct.unpack_from("<4sHB", data, 0)
    if ident != b":W&B" or magic != 0xBEE1:
        raise ValueError(f"not a wandb transaction log (ident={ident!r}, magic={magic:#x})")
    off, parts = _HEADER, b""
    while off + _HEADER <= len(data):
        left = _BLOCK - off % _BLOCK
        if left < _HEADER:  # block trailer
            off += left
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, off)
        off += _HEADER
        chunk, off = data[off:off + length], off + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            parts = chunk
        elif kind == _MIDDLE:
            parts += chunk
        elif kind == _LAST:
            yield parts + chunk
        elif kind == 0 and length == 0:  # zero padding up to the end of the block
            off += left - _HEADER
        else:
            raise ValueError(f"bad wandb log chunk type {kind} at offset {off - _HEADER - length}")


def wandb_history(wandb_dir: Path) -> list[dict[str, object]]:
    """The history rows (one per `wandb.log`) of the one offline run under `wandb_dir/wandb/offline-run-*`."""
    from wandb.proto import wandb_internal_pb2 as pb

    runs = sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))
    if len(runs) != 1:
        raise AssertionError(f"expected one offline wandb run under {wandb_dir}, found {runs}")
    rows = []
    for raw in _wandb_records(runs[0].read_bytes()):
        rec = pb.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            rows.append({(it.key or "/".join(it.nested_key)): json.loads(it.value_json) for it in rec.history.item})
    return rows
