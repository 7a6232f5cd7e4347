"""Which SGLang tests run on both SGLang versions: 0.5.23 (`make test-sglang`, every test in tests/sglang_backend) and
verl 0.9.1's pin 0.5.12 (`make test-verl-sglang`, only the tests named in BOTH_VERSIONS, with `--sglang-version-tests`,
which also leaves out of tests/verl the duplicates of `make test` named in VERL_ONCE).

A test is named here when its verdict can depend on the installed SGLang version: it goes through a branch of
`pat_rollout/sglang/compat.py` (or SGLang behaviour that compat.py does not paper over) that differs between the two,
with the reason beside it. Everything else in tests/sglang_backend runs once, on 0.5.23: the tests without SGLang,
and the pool tests whose SGLang-facing paths a named test already covers on 0.5.12 (docs/testing.md lists each with
its reason). A new test module runs on 0.5.23 only until it is named here.

Keys: "module.py" (every test in it), "module.py::test_name" (every parametrisation), or "module.py::test_name[id]".
`tests/test_sglang_versions.py` checks that every key names a test that exists.
"""

from __future__ import annotations

MARKER = "sglang_version"

BOTH_VERSIONS: dict[str, str] = {
    "test_sglang_compat.py": "compat's CPU workaround (0.5.12's pinned-memory LogitsProcessor)",
    "test_sglang_admission_reset.py": "compat.reset_admission_state: 0.5.23's ratio tracker, 0.5.12's attribute",
    "test_sglang_inventory.py::test_every_name_resolves_on_the_installed_sglang":
        "every SGLang name the backend touches resolves on the installed version",
    "test_sglang_layout_comm.py::test_startup_capture_runs_under_the_base_group":
        "compat.build_methods / startup_capture_method against the installed SGLang's start-up source",
    "test_sglang_replica_input.py": "routing with the installed SGLang's own request types (io_struct)",
    "test_sglang_generate.py::test_stream_chunks_carry_only_new_tokens[tp1]":
        "SGLang's incremental stream chunks (engine._Tracked reads only the new tokens)",
    "test_sglang_pool.py::test_switch_mid_decode_equals_hf":
        "the whole switch: tp_group_patch, output/input paths, reinit_attention, radix prefix API (migrate), "
        "abort export (recompute), refresh_kv_pointers, admission reset",
    "test_sglang_pool_addresses.py": "compat.weight_update_method / weight_update_context, rollback",
    "test_sglang_pool_bounded.py::test_one_backup_per_sync_and_rollback_restores_synced_weights":
        "the weight backup: 0.5.23 takes it at end_weight_update, 0.5.12 (no such call) at the next switch",
    "test_sglang_pool_graphs.py::test_each_layout_replays_its_own_graphs_and_backends":
        "compat.build_methods, startup_capture_method, graph runner and attention state",
    "test_sglang_pool_independent.py": "compat.install_replica_input (0.5.12 replaces Scheduler.recv_requests)",
    "test_sglang_pool_kv_room.py::test_tp2_replica_admits_what_a_tp1_replica_queued[per-replica-input]":
        "compat.refresh_kv_pointers (0.5.12 builds the tables inline), admission reset, 0.5.12's recv_requests",
    "test_sglang_pool_memory.py::test_switch_allocations_in_memory_saver_regions_and_server_args":
        "compat.weights_region and prefill_graph_off_args (0.5.12 piecewise, 0.5.23 prefill graphs)",
    "test_sglang_pool_faults.py::test_hung_rank_misses_the_rpc_deadline_and_breaks_the_pool":
        "a hung rank's stack dump through the installed SGLang's process handling",
    "test_sglang_pool_faults.py::test_killed_scheduler_breaks_the_pool_and_fails_every_request":
        "a killed scheduler: SGLang's SIGQUIT path (0.5.23 adds a subprocess watchdog)",
    "test_sglang_pool_reclaim.py": "compat.startup_load_and_kv_methods: the KV seam the adoption follows (0.5.23 "
        "alloc_memory_pool, 0.5.12 init_memory_pool) and the start-up order it asserts",
    "test_sglang_pool_sampled.py::test_seeded_sampling_survives_switches[llama-migrate]":
        "strict xfail on SGLang's own seed handling (sampling_seed), per version",
    "test_sglang_pool_unseeded.py::test_unseeded_sampling_tp2_ranks_agree[llama-migrate-0]":
        "SGLang's sampler RNG across a switch (pool_switch._reseed)",
}

# tests/verl runs whole on 0.5.12 (verl's own pins of torch and transformers) except these, which `make test` runs with
# the same verl 0.9.1 and touch no SGLang: the fake driver and the reference engine behind verl's server adapter.
# Keys as above ("module.py::[id]": every test of the module with that parametrisation id).
VERL_ONCE: dict[str, str] = {
    "test_verl_generate.py::[fake]": "a fake driver behind verl's server adapter: no engine, no SGLang",
    "test_verl_generate.py::[real]": "the reference engine behind verl's server adapter: no SGLang",
}


def selects(key: str, module: str, name: str, originalname: str) -> bool:
    """Whether BOTH_VERSIONS key `key` names the test `name` (originalname: without its parametrisation id)."""
    mod, _, test = key.partition("::")
    if mod != module:
        return False
    if test.startswith("["):
        return name.endswith(test)
    return not test or test == name or test == originalname
