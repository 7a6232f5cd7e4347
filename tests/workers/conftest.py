"""Fixtures for driver tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from pool_helpers import write_profile


@pytest.fixture
def tiny_profile(tmp_path: Path) -> str:
    return write_profile(tmp_path / "profile.json")
