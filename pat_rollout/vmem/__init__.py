"""Weight memory a grow no longer needs, lent to the KV cache through virtual memory (issue #37 item 3).

`plan`: the pure plan (granule-rounded weight tails, KV regions' reserved ranges, the ordered map/unmap steps of a
switch; stdlib only). `mapper`: the `Mapper` protocol, `FakeMapper` (CPU: what is mapped where, peak physical
bytes) and `apply_switch`, which runs a plan's steps on a mapper. `host`: `HostMapper`, the same protocol on Linux
host memory (mmap reservations, memfd pages: pages really move on a CPU). `cuda`: `CudaMapper`, the CUDA driver's
virtual memory API through ctypes on libcuda.so.1 (imported only where used). `adopt`: copies live parameter and KV
storages into a mapper's ranges and re-points them. Must not import torch, ray or sglang at package import.
"""

from pat_rollout.vmem.mapper import FakeMapper, Mapper, apply_switch, map_initial
from pat_rollout.vmem.plan import CUDA_GRANULE, KvRegion, ReclaimError, ReclaimPlan, Step, WeightStorage

__all__ = ["CUDA_GRANULE", "FakeMapper", "KvRegion", "Mapper", "ReclaimError", "ReclaimPlan", "Step", "WeightStorage",
           "apply_switch", "map_initial"]
