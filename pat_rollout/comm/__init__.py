"""Process groups, TP context and transports.

Owns the distributed plumbing handed explicitly to layers and executors (no module globals).
Must not import ray, sglang or the engine; keep this file free of eager heavy imports.
"""
