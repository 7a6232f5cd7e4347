"""The configurations the simulator validation runs on the CPU pool (`sim_validate`) and simulates
(`sim_validate_report`); a module of its own so that neither of those imports the other for them."""

EAGER = {"eval_every_steps": 8, "min_steps_between_switches": 16, "min_gain_s": 0.0}  # planner options of PAT runs
CONFIGS = {  # name -> (policy, initial_tp, planner profile)
    "static 2xTP1": ("static", 1, None),
    "static 1xTP2": ("static", 2, None),
    "PAT, CPU profile": ("pat", 1, "cpu_ref_llama_demo"),
    "PAT, H100 profile": ("pat", 1, "h100_llama31_8b"),
}
