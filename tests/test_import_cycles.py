"""No import circles anywhere in pat_rollout, and a driver that imports no backend: read from the source with `ast`.

The rule: every `import` / `from ... import` statement in a module is an edge of the import graph wherever it
stands: at module level, inside a function or method (a lazy import still ties the two modules together), or under
`if TYPE_CHECKING:`. `from pkg import name` is an edge to the module `pkg.name` when that is a module, else to
`pkg`. Two things are not edges: the implicit import of a module's parent packages (a package re-exporting its
submodules would otherwise be a circle with each of them), and `importlib.import_module(...)` by name, which is how
`driver.backends` reaches a backend it does not depend on.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_files(root: Path, package: str = "pat_rollout") -> dict[str, Path]:
    """Dotted module name -> file, for every module of `package` under `root` (packages by their __init__)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path], package: str = "pat_rollout") -> set[str]:
    """The modules of `modules` that `name` (at `path`) imports anywhere in its source."""
    def known(target: str) -> str | None:  # the module itself, else the nearest package that holds it
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(known(a.name) for a in node.names if a.name.split(".")[0] == package)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package holding this module, one level up per extra dot
                base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] == package:
                out.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else known(base) for a in node.names)
    return {m for m in out if m is not None and m != name}


def import_graph(root: Path, package: str = "pat_rollout") -> dict[str, set[str]]:
    modules = module_files(root, package)
    return {name: imports_of(name, path, modules, package) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None. Depth-first, in sorted order so the answer is stable."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_no_import_cycles_in_pat_rollout() -> None:
    graph = import_graph(ROOT)
    # The graph is really read: a few edges the code has, each of a different kind.
    assert "pat_rollout.driver.loop" in graph["pat_rollout.driver.api"]  # module level
    assert "pat_rollout.workers.group" in graph["pat_rollout.workers.backend"]  # inside a function
    assert "pat_rollout.workers.group" in graph["pat_rollout.workers.reconfigure"]  # under TYPE_CHECKING
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_detector_names_a_circle(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub import b  # a package re-exporting: no circle\n")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import X\n")
    (pkg / "sub" / "c.py").write_text("from .. import a\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.sub.c"] == {"pkg.a"} and graph["pkg.sub.b"] == {"pkg.sub.c"}
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.sub.c", "pkg.a"]


def test_the_driver_imports_no_backend() -> None:
    """The driver reaches its backends only through the registry: no statement of driver/ names workers/ or
    sglang/, and importing the driver loads neither them nor ray or sglang."""
    graph = import_graph(ROOT)
    driver = {m: deps for m, deps in graph.items() if m == "pat_rollout.driver" or m.startswith("pat_rollout.driver.")}
    assert "pat_rollout.driver.api" in driver
    backends = ("pat_rollout.workers", "pat_rollout.sglang")
    bad = {m: sorted(d for d in deps if d.startswith(backends)) for m, deps in driver.items()}
    assert not any(bad.values()), {m: d for m, d in bad.items() if d}
    code = ("import sys\nfrom pat_rollout.driver import RolloutDriver\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'sglang')"
            " or m.startswith(('pat_rollout.workers', 'pat_rollout.sglang')))\n"
            "assert not bad, bad\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"importing the driver pulled in a backend:\n{res.stderr}"
