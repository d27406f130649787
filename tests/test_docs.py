"""The docs as a front door: every relative link in README.md and docs/*.md reaches a file (and a
heading, when it names one), the README indexes every doc, and CI runs the README's test command."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    out, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#+\s+(.*)$", line)):
            out.add(_slug(m.group(1)))
    return out


def test_every_relative_link_in_the_docs_reaches_its_file_and_heading():
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                broken.append(f"{doc.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{doc.name}: {target} (no such heading)")
    assert broken == []


def test_the_readme_indexes_every_doc():
    readme = (ROOT / "README.md").read_text()
    assert [d.name for d in sorted((ROOT / "docs").glob("*.md")) if f"](docs/{d.name})" not in readme] == []


def test_ci_runs_the_readme_test_command_word_for_word():
    command = next(line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "python -m pytest -q" in line)
    assert f"    {command}\n" in (ROOT / "README.md").read_text()
