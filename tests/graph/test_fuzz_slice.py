"""A seeded slice of benchmarks/fuzz_graphs.py: mutated shipped graphs and inventories through
`flowrl check`'s code path give no traceback, no hang and only located, bounded messages.

The benchmark holds each file to 5 s (a speed); here a file counts as hung only past HANG_S, so a
busy machine cannot fail the slice. The work a hostile file may cost is bounded by counts in
tests/graph/test_hostile_files.py and tests/placement/test_scale.py."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HANG_S = 30.0


def _fuzz_module():
    spec = importlib.util.spec_from_file_location("fuzz_graphs", ROOT / "benchmarks" / "fuzz_graphs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_two_hundred_mutated_files_give_no_traceback_no_hang_and_located_messages():
    stats = _fuzz_module().fuzz(200, seed=12, limit=HANG_S)
    assert stats["files"] == 200
    assert (stats["tracebacks"], stats["slow"], stats["unlocated"], stats["too_long"]) == (0, 0, 0, 0), stats["failures"][:3]
    assert stats["rejected"] > 50 and stats["ok"] + stats["errors"] > 0  # both paths ran
