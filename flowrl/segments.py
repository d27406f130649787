"""JSONL files that grow for the whole run (the ledger, the metrics rows), kept bounded on disk:
past a size the file is compressed into the next numbered segment and started anew.

    rotate(run_dir / "ledger.jsonl")       # -> ledger.1.jsonl.gz, a fresh ledger.jsonl
    rows = read_all(run_dir / "ledger.jsonl")   # every segment, oldest first, then the live file

Compressed JSONL is about 10x smaller; a reader of the live file alone still sees the recent rows.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path


def segments(path: Path) -> list[Path]:
    """`name.N.jsonl.gz` next to `name.jsonl`, oldest first."""
    path = Path(path)
    stem = path.name.removesuffix(".jsonl")
    found = []
    for p in path.parent.glob(f"{stem}.*.jsonl.gz"):
        middle = p.name[len(stem) + 1:-len(".jsonl.gz")]
        if middle.isdigit():
            found.append((int(middle), p))
    return [p for _, p in sorted(found)]


def rotate(path: Path) -> Path:
    """Compress `path` into the next segment and truncate it (the caller reopens it)."""
    path = Path(path)
    existing = segments(path)
    n = 1 + (int(existing[-1].name.split(".")[-3]) if existing else 0)
    seg = path.with_name(f"{path.name.removesuffix('.jsonl')}.{n}.jsonl.gz")
    tmp = seg.with_name(seg.name + ".tmp")
    with open(path, "rb") as src, gzip.open(tmp, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    os.replace(tmp, seg)
    with open(path, "w"):
        pass
    return seg


def read_all(path: Path) -> list[dict]:
    """Every row of `path` and its segments; torn or foreign lines are skipped."""
    rows = []
    for seg in segments(path):
        with gzip.open(seg, "rt", errors="replace") as f:
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
