"""Every shipped graph plans with its documented outcome: graphs/ and examples/gpu/ cleanly,
each examples/wrong/ graph with exactly the finding code its header names."""

import re
from pathlib import Path

import pytest

from flowrl.graph import load_graph
from flowrl.placement import get_inventory, make_plan
from flowrl.placement.declared import DeclaredInventory

ROOT = Path(__file__).resolve().parents[2]


def header(path: Path) -> tuple[str | None, str | None]:
    text = path.read_text()
    inv = re.search(r"--inventory (\S+)", text)
    code = re.search(r"Finding: (\S+)", text)
    return (inv.group(1) if inv else None), (code.group(1) if code else None)


def plan_for(path: Path):
    inv_path, _ = header(path)
    inv = DeclaredInventory.load(ROOT / inv_path) if inv_path else get_inventory()
    return make_plan(load_graph(path), inv)


@pytest.mark.parametrize("path", sorted((ROOT / "graphs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_graph_plans_without_errors_here(path):
    plan = plan_for(path)
    assert plan.ok and not plan.warnings, [f.message for f in plan.findings]


@pytest.mark.parametrize("path", sorted((ROOT / "examples/gpu").glob("*.yaml")), ids=lambda p: p.name)
def test_gpu_example_plans_cleanly_on_its_inventory(path):
    assert header(path)[0], "GPU examples name their inventory in a `# Check:` line"
    plan = plan_for(path)
    assert not [f for f in plan.findings if f.code != "group-network"], [f.message for f in plan.findings]


WRONG = sorted((ROOT / "examples/wrong").glob("*.yaml"))


@pytest.mark.parametrize("path", WRONG, ids=lambda p: p.name)
def test_wrong_example_produces_exactly_its_documented_code(path):
    inv, code = header(path)
    assert inv and code, "wrong examples name their inventory and finding code in the header"
    plan = plan_for(path)
    assert {f.code for f in plan.findings if f.severity != "info"} == {code}
    exit_line = re.search(r"\(exit (\d)\)", path.read_text())
    assert exit_line and int(exit_line.group(1)) == (1 if plan.errors else 0)


def test_every_finding_family_has_a_wrong_example():
    from flowrl.placement.findings import CODES

    shown = {header(p)[1] for p in WRONG}
    families = {family for code, (sev, family, _) in CODES.items() if sev != "info"}
    assert {CODES[c][1] for c in shown} == families


def test_docs_list_every_finding_code():
    from flowrl.placement.findings import CODES

    text = (ROOT / "docs/placement.md").read_text()
    assert [c for c in CODES if f"`{c}`" not in text] == []
