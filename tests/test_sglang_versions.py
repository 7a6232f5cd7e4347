"""tests/sglang_versions.py names only tests that exist (a renamed test would silently leave the 0.5.12 run)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from sglang_versions import BOTH_VERSIONS, selects

BACKEND = Path(__file__).parent / "sglang_backend"


def _tests(module: Path) -> set[str]:
    tree = ast.parse(module.read_text())
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.name.startswith("test_")}


@pytest.mark.parametrize("key", sorted(BOTH_VERSIONS))
def test_every_key_names_an_existing_test(key):
    module, _, test = key.partition("::")
    path = BACKEND / module
    assert path.is_file(), f"{key}: no {path}"
    if test:
        name, _, param = test.partition("[")
        assert name in _tests(path), f"{key}: no {name} in {path}"
        if param:  # the id must appear among the test's parametrisations: checked where SGLang is installed
            assert param.endswith("]"), key


def test_selects_by_module_test_and_id():
    assert selects("m.py", "m.py", "test_a[x]", "test_a")
    assert selects("m.py::test_a", "m.py", "test_a[x]", "test_a")
    assert selects("m.py::test_a[x]", "m.py", "test_a[x]", "test_a")
    assert not selects("m.py::test_a[y]", "m.py", "test_a[x]", "test_a")
    assert not selects("m.py::test_a", "m.py", "test_ab", "test_ab")
    assert not selects("m.py", "n.py", "test_a", "test_a")
