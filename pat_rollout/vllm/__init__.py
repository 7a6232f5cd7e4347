"""vLLM backend (`backend="vllm"`): pat_rollout's Pool protocol on real vLLM v1 engines (see README.md).

Importing this package does not import vllm or torch; `replica.py` does, and needs the separate venv
`make install-vllm` builds.
"""
