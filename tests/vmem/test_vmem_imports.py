"""pat_rollout.vmem's plan and fake mapper are pure stdlib (the CPU tests and the planner-side room rule need no
torch); the CUDA mapper loads libcuda only when constructed."""

from __future__ import annotations

import subprocess
import sys


def test_vmem_imports_no_torch_ray_or_sglang():
    code = ("import sys, pat_rollout.vmem, pat_rollout.vmem.cuda, pat_rollout.vmem.host; "
            "print(sorted({'torch', 'ray', 'sglang'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
