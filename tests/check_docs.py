"""Docs check (run by `make lint`): the commands and links in the Markdown docs name things that exist.

Checked in README.md, docs/*.md and every *.md under pat_rollout/, examples/ and recipes/:

- every `python -m pat_rollout...` / `python3 -m pat_rollout...` (anywhere in the text) names a runnable module:
  `pat_rollout/a/b.py`, or `pat_rollout/a/b/__main__.py` for a package. Files are looked up, nothing is imported
  (no torch, ray or sglang needed); a placeholder such as `pat_rollout.bench.<name>` is skipped;
- every `make X` inside inline code or a fenced code block names a target of the Makefile;
- every relative Markdown link or image `[text](path#anchor)` outside code resolves to a file or folder, and its anchor (if
  any, into a .md file) to a heading of that file, slugged as GitHub does.

Pure stdlib, runs in well under a second: `python tests/check_docs.py [ROOT]`; exit 1 with one line per problem.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Files a branch in flight adds: a link to one of them that does not exist yet is a note, not an error; once the
# file exists it is checked like any other. Empty on main.
PENDING_FILES: set[str] = set()

PY_MODULE = re.compile(r"\bpython3?\s+-m\s+(pat_rollout(?:\.[A-Za-z_]\w*)*)(\.?<)?")
MAKE = re.compile(r"(?:^|[\s;&|(`$])make\s+((?:[A-Za-z_][\w.-]*=\S*\s+)*)([A-Za-z][\w.-]*)")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
TARGET_LINE = re.compile(r"^([A-Za-z][\w.-]*(?:[ \t]+[A-Za-z][\w.-]*)*)[ \t]*:(?!=)")


def doc_files(root: Path) -> list[Path]:
    files = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    for folder in ("pat_rollout", "examples", "recipes"):
        files += sorted((root / folder).rglob("*.md"))
    return [f for f in files if f.is_file()]


def make_targets(makefile: Path) -> set[str]:
    """Explicit targets of a Makefile (rules and .PHONY names; pattern and variable targets are not names)."""
    targets: set[str] = set()
    if not makefile.is_file():
        return targets
    for line in makefile.read_text().splitlines():
        if line.startswith((".PHONY:", ".PHONY :")):
            targets.update(line.split(":", 1)[1].split())
        elif (m := TARGET_LINE.match(line)) and not line.startswith("\t"):
            targets.update(m.group(1).split())
    return targets


def split_code(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(code, prose): numbered lines of fenced blocks plus inline code spans, and the prose with spans removed."""
    code: list[tuple[int, str]] = []
    prose: list[tuple[int, str]] = []
    fence: str | None = None
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence is not None:
            if m and m.group(1) == fence:
                fence = None
            else:
                code.append((n, line))
            continue
        if m:
            fence = m.group(1)
            continue
        if line.startswith(("    ", "\t")) and line.strip():  # an indented code block line
            code.append((n, line))
            continue
        code += [(n, s.group(2)) for s in CODE_SPAN.finditer(line)]
        prose.append((n, CODE_SPAN.sub(" ", line)))
    return code, prose


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link keeps its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    out: set[str] = set()
    seen: dict[str, int] = {}
    fence = None
    for line in path.read_text().splitlines():
        m = FENCE.match(line)
        if fence is not None:
            fence = None if m and m.group(1) == fence else fence
            continue
        if m:
            fence = m.group(1)
            continue
        if h := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line):
            s = slug(h.group(1))
            k = seen.get(s, 0)
            out.add(s if k == 0 else f"{s}-{k}")
            seen[s] = k + 1
    return out


def module_exists(root: Path, module: str) -> bool:
    path = root.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()


def check_file(root: Path, doc: Path, targets: set[str], notes: list[str] | None = None) -> list[str]:
    text = doc.read_text()
    rel = doc.relative_to(root)
    errors: list[str] = []
    code, prose = split_code(text)
    for n, line in enumerate(text.splitlines(), 1):
        for m in PY_MODULE.finditer(line):
            if m.group(2):  # `pat_rollout.bench.<name>`: a placeholder
                continue
            if not module_exists(root, m.group(1)):
                errors.append(f"{rel}:{n}: `python -m {m.group(1)}`: no module {m.group(1)} "
                              f"({m.group(1).replace('.', '/')}.py or .../__main__.py)")
    for n, snippet in code:
        for m in MAKE.finditer(snippet):
            if m.group(2) not in targets:
                errors.append(f"{rel}:{n}: `make {m.group(2)}`: no such target in the Makefile")
    for n, line in prose:
        for m in LINK.finditer(line):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
                continue
            file_part, _, anchor = target.partition("#")
            dest = (doc.parent / file_part).resolve() if file_part else doc
            if file_part and not dest.exists():
                try:
                    pending = dest.relative_to(root.resolve()).as_posix() in PENDING_FILES
                except ValueError:
                    pending = False
                if pending:
                    if notes is not None:
                        notes.append(f"{rel}:{n}: link to {file_part}: not here yet (another branch adds it)")
                    continue
                errors.append(f"{rel}:{n}: link to {target}: {file_part} does not exist")
                continue
            if anchor and dest.is_file() and dest.suffix == ".md" and anchor not in anchors(dest):
                errors.append(f"{rel}:{n}: link to {target}: no heading with anchor #{anchor} in {file_part or rel}")
    return errors


def check(root: Path = ROOT, files: list[Path] | None = None, notes: list[str] | None = None) -> list[str]:
    """Every problem found, one line each ('file:line: what'); [] when the docs are consistent."""
    targets = make_targets(root / "Makefile")
    errors: list[str] = []
    for doc in files if files is not None else doc_files(root):
        errors += check_file(root, doc, targets, notes)
    return errors


def main(argv: list[str]) -> int:
    root = Path(argv[1]).resolve() if len(argv) > 1 else ROOT
    notes: list[str] = []
    errors = check(root, notes=notes)
    for line in notes:
        print(f"note: {line}")
    for line in errors:
        print(line)
    print(f"docs check: {len(doc_files(root))} files, {len(errors)} problem(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
