"""Helpers: small graphs and inventories written inline, planned in one call."""

from pathlib import Path

import pytest

from flowrl.graph import load_graph_text
from flowrl.placement import make_plan
from flowrl.placement.declared import DeclaredInventory

ROOT = Path(__file__).resolve().parents[2]
INVENTORIES = ROOT / "examples" / "inventories"
R = "tests.placement.roles:"


def graph(nodes: str, extra: str = ""):
    """A graph whose nodes are given as YAML lines under `nodes:` (kinds from roles.py as R...)."""
    return load_graph_text("nodes:\n" + nodes.replace("R:", R) + "\n" + extra, "test.yaml")


def inventory(name_or_text: str) -> DeclaredInventory:
    """A shipped inventory by file name, or inline YAML."""
    if name_or_text.endswith(".yaml"):
        return DeclaredInventory.load(INVENTORIES / name_or_text)
    return DeclaredInventory.from_text(name_or_text, "inv.yaml")


def plan_of(nodes: str, inv, extra: str = ""):
    return make_plan(graph(nodes, extra), inventory(inv) if isinstance(inv, str) else inv)


def codes(plan, severity=("error", "warning")) -> set[tuple[str, str | None]]:
    return {(f.code, f.node) for f in plan.findings if f.severity in severity}


@pytest.fixture
def a100():
    return inventory("a100x8-nvlink.yaml")
