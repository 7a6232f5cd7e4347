"""SGLang backend: pat_rollout's engine protocol on real SGLang engines (`engine.py`), their launch
settings (`launch.py`) and a model-registry subset (`models/`).

Importing this package does not import sglang or torch; `engine.py` and `models/` do, and need the
separate venv described in INSTALL.md.
"""
