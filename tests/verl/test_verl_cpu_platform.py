"""pat_rollout's CPU platform for verl (pat_rollout/verl/cpu_platform.py) and the v1 metrics sampler
(pat_rollout/verl/replay_buffer.py), without running the trainer (tests/verl/test_main_ppo_e2e.py does)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl")

REPO = Path(__file__).resolve().parents[2]

PROBE = r"""
import json, os
import torch.distributed as dist
import verl
from verl.plugin.platform import PlatformRegistry
out = {"registered": PlatformRegistry.get("cpu") is not None}
if out["registered"]:
    import verl.utils.distributed as vd
    import verl.utils.fsdp_utils as fu
    import verl.utils.model as vm
    from verl.utils.device import get_device_id, get_device_name, get_nccl_backend, get_resource_name, get_torch_device
    vd.initialize_global_process_group_ray()  # world of 1 (RANK/WORLD_SIZE/MASTER_* below)
    out.update(device=get_device_name(), device_id=get_device_id(), backend=get_nccl_backend(),
               resource=get_resource_name(), pg_backend=dist.get_backend(),
               memory_allocated=get_torch_device().memory_allocated(),
               pin_memory=fu.CPUOffloadPolicy(pin_memory=True).pin_memory,
               engine_device=os.environ.get("VERL_ENGINE_DEVICE"),
               valuehead_patched=getattr(vm.load_valuehead_model, "_pat_cpu", False))
    dist.destroy_process_group()
print("PROBE" + json.dumps(out))
"""


def _probe(**env: str) -> dict:
    full = {k: v for k, v in os.environ.items() if k not in ("VERL_PLATFORM", "VERL_ENGINE_DEVICE")}
    full.update(PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
                RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000),
                **env)
    out = subprocess.run([sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith("PROBE"))
    return json.loads(line[len("PROBE"):])


def test_cpu_platform_installed_only_with_verl_platform_cpu():
    assert _probe() == {"registered": False}  # GPU machines: the entry point leaves verl's platforms alone
    got = _probe(VERL_PLATFORM="cpu")
    assert got == {"registered": True, "device": "cpu", "device_id": "cpu", "backend": "gloo", "resource": "GPU",
                   "pg_backend": "gloo", "memory_allocated": 0, "pin_memory": False, "engine_device": "cuda",
                   "valuehead_patched": True}


def test_verl_version_check_names_both_versions():
    from pat_rollout.verl import cpu_platform

    with pytest.raises(RuntimeError, match=r"written for verl==0\.9\.1, found verl==0\.10\.0"):
        cpu_platform.check_verl_version("0.10.0")
    error = RuntimeError("version mismatch")
    with pytest.raises(RuntimeError, match="version mismatch"):  # what verl's get_platform() then raises
        cpu_platform._unsupported_platform_class(error)()


def test_pat_replay_buffer_adds_stage_metrics_once_per_step(monkeypatch):
    pytest.importorskip("transfer_queue", reason="verl's v1 trainer needs TransferQueue (setup.py's verl extra)")
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    from pat_rollout.verl import replay_buffer

    args = dict(trainer_config={}, max_off_policy_threshold=None, max_off_policy_strategy="drop", sampler_kwargs={})
    with pytest.raises(ValueError, match="trainer_mode=sync only.*got trainer_mode='async'"):
        replay_buffer.PatReplayBuffer(trainer_mode="async", **args)
    monkeypatch.setattr(ReplayBuffer, "sample", lambda self, step, partition, size: (f"{partition}{step}", {"a": 1}))
    calls = []
    monkeypatch.setattr(replay_buffer, "pat_stage_metrics", lambda: calls.append(1) or {"timing_s/pat/x": 2.0})
    buf = replay_buffer.PatReplayBuffer(trainer_mode="sync", **args)
    assert buf.sample(1, "train", 4) == ("train1", {"a": 1, "timing_s/pat/x": 2.0})
    assert buf.sample(1, "train", 4) == ("train1", {"a": 1})  # parameter_sync_step > 1: one stage, reported once
    assert buf.sample(1, "val", 4) == ("val1", {"a": 1})
    assert buf.sample(2, "train", 4) == ("train2", {"a": 1, "timing_s/pat/x": 2.0})
    assert len(calls) == 2
