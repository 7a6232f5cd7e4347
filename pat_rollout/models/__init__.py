"""Tiny random-weight HuggingFace models made locally (tests, CPU demo): no model hub needed."""

from pat_rollout.models.tiny import TINY_PRESETS, make_tiny_model

__all__ = ["TINY_PRESETS", "make_tiny_model"]
