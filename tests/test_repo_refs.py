"""The repository stands alone: nothing in the code, configs or user docs refers to design notes
or research files outside it (docs/design.md is the design of record)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = re.compile(r"\bresearch/[\w-]+\.md|\bDESIGN(\.md| §)|\.\./shared\b")
WHERE = ["whale", "configs", "benchmarks", "scripts", "examples", "docs/guides"]


def files() -> list[Path]:
    out = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in WHERE:
        out += [p for p in sorted((ROOT / folder).rglob("*")) if p.suffix in (".py", ".md", ".yaml", ".sh", ".j2")]
    return out


def test_no_reference_to_files_outside_the_repository():
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in files()
             for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if OUTSIDE.search(line)]
    assert not found, "\n".join(found)


def test_the_pattern_catches_what_it_is_for():
    assert OUTSIDE.search("(research/stack.md §2)") and OUTSIDE.search("the contract of DESIGN §4")
    assert not OUTSIDE.search("docs/design.md, 4.1") and not OUTSIDE.search("docs/results/general_search/")
