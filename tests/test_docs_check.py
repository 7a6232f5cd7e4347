"""tests/check_docs.py (run by `make lint`): it passes on this repository's docs and fails, naming the line, on a
broken `python -m pat_rollout...` command, a broken `make` target and a broken relative link or anchor."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import check_docs

MAKEFILE = ".PHONY: install demo\ninstall: $(STAMP)\n\ndemo: install\n\t$(PY) -m pat_rollout.demo\nPY := python\n"


def make_repo(tmp_path: Path, doc: str) -> Path:
    """A tiny repository: a Makefile with targets install and demo, modules pat_rollout.demo and pat_rollout.sim
    (a package with __main__), docs/guide.md with a heading, and README.md = `doc`."""
    (tmp_path / "Makefile").write_text(MAKEFILE)
    (tmp_path / "pat_rollout" / "sim").mkdir(parents=True)
    (tmp_path / "pat_rollout" / "__init__.py").write_text("")
    (tmp_path / "pat_rollout" / "demo.py").write_text("")
    (tmp_path / "pat_rollout" / "sim" / "__init__.py").write_text("")
    (tmp_path / "pat_rollout" / "sim" / "__main__.py").write_text("")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n\n## Using it from verl\n\nBack to the [README](../README.md).\n")
    (tmp_path / "README.md").write_text(doc)
    return tmp_path


GOOD = """# Project

    make install && make demo

Run `python -m pat_rollout.sim --lengths x.csv` or `python3 -m pat_rollout.demo`; benchmarks are
`python -m pat_rollout.bench.<name>`. See [the guide](docs/guide.md#using-it-from-verl) and [top](#project),
[verl](https://github.com/verl-project/verl). In prose, "make sure" is not a command.
"""


def test_passes_on_consistent_docs(tmp_path: Path) -> None:
    root = make_repo(tmp_path, GOOD)
    assert check_docs.check(root) == []


def test_fails_on_a_missing_module(tmp_path: Path) -> None:
    root = make_repo(tmp_path, GOOD + "\nThen `python -m pat_rollout.bench.no_such_bench --fast`.\n")
    errors = check_docs.check(root)
    assert len(errors) == 1, errors
    assert errors[0].startswith("README.md:9: `python -m pat_rollout.bench.no_such_bench`: no module")


def test_a_package_without_main_is_not_runnable(tmp_path: Path) -> None:
    root = make_repo(tmp_path, "Run `python -m pat_rollout`.\n")
    assert check_docs.check(root) == ["README.md:1: `python -m pat_rollout`: no module pat_rollout "
                                      "(pat_rollout.py or .../__main__.py)"]


def test_fails_on_a_missing_make_target(tmp_path: Path) -> None:
    root = make_repo(tmp_path, GOOD + "\n```\nmake install && make test-everything\n```\n")
    assert check_docs.check(root) == ["README.md:10: `make test-everything`: no such target in the Makefile"]


def test_fails_on_a_missing_make_target_in_an_inline_span(tmp_path: Path) -> None:
    root = make_repo(tmp_path, "Run `make VENV=x benchmarks` first.\n")
    assert check_docs.check(root) == ["README.md:1: `make benchmarks`: no such target in the Makefile"]


def test_fails_on_a_broken_link(tmp_path: Path) -> None:
    root = make_repo(tmp_path, GOOD + "\nSee [the planner](docs/planner.md).\n")
    assert check_docs.check(root) == ["README.md:9: link to docs/planner.md: docs/planner.md does not exist"]


def test_fails_on_a_broken_image(tmp_path: Path) -> None:
    root = make_repo(tmp_path, GOOD + "\n![layouts over time](docs/layouts.png)\n")
    assert check_docs.check(root) == ["README.md:9: link to docs/layouts.png: docs/layouts.png does not exist"]


def test_fails_on_a_broken_anchor(tmp_path: Path) -> None:
    root = make_repo(tmp_path, GOOD + "\nSee [options](docs/guide.md#options) and [here](#no-such-heading).\n")
    errors = check_docs.check(root)
    assert errors == ["README.md:9: link to docs/guide.md#options: no heading with anchor #options in docs/guide.md",
                      "README.md:9: link to #no-such-heading: no heading with anchor #no-such-heading in README.md"]


def test_checks_docs_folder_and_relative_paths(tmp_path: Path) -> None:
    root = make_repo(tmp_path, GOOD)
    (root / "docs" / "guide.md").write_text("# Guide\n\n## Using it from verl\n\nSee [the readme](README.md) and `make demo`.\n")
    assert check_docs.check(root) == ["docs/guide.md:5: link to README.md: README.md does not exist"]


def test_links_and_commands_inside_code_blocks_are_not_links(tmp_path: Path) -> None:
    root = make_repo(tmp_path, "```\n[not a link](nowhere.md)\n```\n")
    assert check_docs.check(root) == []


def test_the_repository_docs_pass() -> None:
    notes: list[str] = []
    assert check_docs.check(check_docs.ROOT, notes=notes) == []
    assert (check_docs.ROOT / "docs").is_dir()


def test_the_command_line_exit_code(tmp_path: Path) -> None:
    script = Path(check_docs.__file__)
    ok = subprocess.run([sys.executable, str(script), str(make_repo(tmp_path, GOOD))], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    (tmp_path / "README.md").write_text(GOOD + "\n`make nothing`\n")
    bad = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode == 1
    assert "README.md:9: `make nothing`: no such target in the Makefile" in bad.stdout
