"""Files that grow for the whole run (the ledger, the metrics rows, the trace), kept bounded on
disk: past a size the file is compressed into the next numbered segment and started anew.

    rotate(run_dir / "ledger.jsonl")       # -> ledger.1.jsonl.gz, a fresh ledger.jsonl
    rows = read_all(run_dir / "ledger.jsonl")   # every segment, oldest first, then the live file
    numbered(run_dir / "trace.json")       # {1: trace.1.json.gz, 2: trace.2.json, ...}

A segment of `name.ext` is `name.N.ext.gz`, or `name.N.ext` while it is not compressed (yet): the
trace compresses its segments on a thread, and a crash can leave one whole but uncompressed.
Compressed JSONL is about 10x smaller; a reader of the live file alone still sees the recent rows.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path


def numbered(path: Path) -> dict[int, Path]:
    """The segments of `path` by number: `name.N.ext.gz`, or `name.N.ext` where no `.gz` of that
    number exists (compressed whole, then renamed: a `.gz` is never half a segment)."""
    path = Path(path)
    stem, ext = path.stem, path.suffix
    found: dict[int, Path] = {}
    for p in path.parent.glob(f"{stem}.*{ext}*"):
        middle, _, rest = p.name[len(stem) + 1:].partition(".")
        if middle.isdigit() and f".{rest}" in (ext, f"{ext}.gz"):
            if rest.endswith(".gz") or int(middle) not in found:
                found[int(middle)] = p
    return found


def segments(path: Path) -> list[Path]:
    """The segments of `path`, oldest first."""
    found = numbered(path)
    return [found[n] for n in sorted(found)]


def next_number(path: Path) -> int:
    """The number `path`'s next segment takes."""
    return 1 + max(numbered(path), default=0)


def compress(path: Path) -> Path:
    """`path` -> `path`.gz, `path` removed (a segment written whole and left alone). Returns the `.gz`."""
    path = Path(path)
    seg = _gzip(path, path.with_name(path.name + ".gz"))
    path.unlink()
    return seg


def rotate(path: Path) -> Path:
    """Compress `path` into the next segment and truncate it (the caller reopens it)."""
    path = Path(path)
    seg = _gzip(path, path.with_name(f"{path.stem}.{next_number(path)}{path.suffix}.gz"))
    with open(path, "w"):
        pass
    return seg


def _gzip(src: Path, seg: Path) -> Path:
    """`src` compressed into `seg`, whole before it takes that name (a `.gz` is never half a segment)."""
    tmp = seg.with_name(seg.name + ".tmp")
    try:
        with open(src, "rb") as f, gzip.open(tmp, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(f, dst, 1 << 20)
        os.replace(tmp, seg)
    finally:
        tmp.unlink(missing_ok=True)
    return seg


def open_text(path: Path):
    """A segment (compressed or not) or a live file, for reading text."""
    path = Path(path)
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def read_all(path: Path) -> list[dict]:
    """Every row of `path` and its segments; torn or foreign lines are skipped."""
    rows = []
    for seg in segments(path):
        with open_text(seg) as f:
            rows.extend(_parse(f))
    return rows + read_file(path)


def read_file(path: Path) -> list[dict]:
    """The rows of one JSONL file (none if it does not exist); torn or foreign lines are skipped."""
    if not Path(path).exists():
        return []
    with open(path, errors="replace") as f:
        return _parse(f)


def _parse(lines) -> list[dict]:
    out = []
    for line in lines:
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out
