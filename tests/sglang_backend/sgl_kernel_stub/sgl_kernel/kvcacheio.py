"""CPU stand-in for `sgl_kernel.kvcacheio` (SGLang 0.5.12 imports it at module level in
mem_cache/memory_pool_host.py and hisparse_memory_pool.py).

These copy KV between the device pool and a host pool (hierarchical cache, HiSparse). The CPU tests never
enable either, so nothing here runs on their path: every function raises instead of guessing a layout.
"""

from __future__ import annotations

from sgl_kernel import _unsupported

_REASON = "implements no host KV cache transfers (hierarchical cache / HiSparse are off in the CPU tests)"


# The real wheel's (sglang-kernel 0.4.2.post2) public functions.
_HOST_CACHE_ONLY = (
    "transfer_kv_per_layer",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_per_layer_ph_lf",
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph",
    "transfer_kv_direct",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_all_layer_mla",
    "transfer_kv_all_layer_mla_lf_pf",
)
for _name in _HOST_CACHE_ONLY:
    globals()[_name] = _unsupported(f"kvcacheio.{_name}", _REASON)
