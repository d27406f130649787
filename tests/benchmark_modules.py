"""Import a script of benchmarks/ by its module name, for tests of its parts."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")


def benchmark(name: str):
    """benchmarks/NAME.py as a module (its folder is on sys.path only while it is imported)."""
    sys.path.insert(0, BENCHMARKS)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(BENCHMARKS)
