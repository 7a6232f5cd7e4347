"""Benchmarks runnable as `python -m pat_rollout.bench.<name>`; printed reports, never test gates."""
