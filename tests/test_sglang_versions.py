"""tests/sglang_versions.py names only tests that exist (a renamed test would silently leave the 0.5.12 run)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from sglang_versions import BOTH_VERSIONS, VERL_ONCE, selects

BACKEND = Path(__file__).parent / "sglang_backend"
VERL = Path(__file__).parent / "verl"


def _tests(module: Path) -> set[str]:
    tree = ast.parse(module.read_text())
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.name.startswith("test_")}


@pytest.mark.parametrize("folder,key", [*((BACKEND, k) for k in sorted(BOTH_VERSIONS)),
                                        *((VERL, k) for k in sorted(VERL_ONCE))], ids=lambda x: str(x).split("/")[-1])
def test_every_key_names_an_existing_test(folder, key):
    module, _, test = key.partition("::")
    path = folder / module
    assert path.is_file(), f"{key}: no {path}"
    if test and not test.startswith("["):
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
    assert selects("m.py::[x]", "m.py", "test_a[x]", "test_a") and selects("m.py::[x]", "m.py", "test_b[x]", "test_b")
    assert not selects("m.py::[x]", "m.py", "test_a[y]", "test_a")
