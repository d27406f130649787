"""The import layering of flowrl (pyproject.toml [tool.importlinter]; docs/architecture.md): a new
back edge between the runtime's programs, or an import circle anywhere in flowrl, fails here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_linter_contracts_hold():
    # in a process of its own: import-linter reconfigures logging, which disabled the loggers of
    # modules imported before it (a later test's caplog then saw nothing)
    code = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(ROOT / 'pyproject.toml')!r}, no_cache=True))")
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": path})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.find_modules_directly_imported_by(w)))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


@pytest.fixture(scope="module")
def graph():
    sys.path.insert(0, str(ROOT))
    try:
        return grimp.build_graph("flowrl", exclude_type_checking_imports=True, cache_dir=None)
    finally:
        sys.path.remove(str(ROOT))


def test_no_module_of_flowrl_is_in_an_import_circle(graph):
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_circle(graph):
    graph.add_import(importer="flowrl.runtime.protocol.messages", imported="flowrl.runtime.protocol.ledger")
    graph.add_import(importer="flowrl.runtime.protocol.ledger", imported="flowrl.runtime.protocol.messages")
    assert ["flowrl.runtime.protocol.ledger", "flowrl.runtime.protocol.messages"] in _cycles(graph)


def test_no_runtime_module_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "flowrl" / "runtime").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}, "split these modules (docs/architecture.md says which part owns what)"


def _attributes(cls) -> set[str]:
    """What a class holds: the `self.X` it assigns anywhere, and its annotated class fields."""
    import ast

    names = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for e in ast.walk(target):
                    if (isinstance(e, ast.Attribute) and isinstance(e.ctx, ast.Store)
                            and isinstance(e.value, ast.Name) and e.value.id == "self"):
                        names.add(e.attr)
    names.update(n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name))
    return names


# A record, not a component: what one process is told before it starts (a flat JSON document,
# written by the controller's Wiring, read once by the worker); it holds no behaviour.
RECORDS = {"flowrl/runtime/protocol/procspec.py:ProcSpec"}


def test_no_runtime_class_holds_more_than_15_attributes():
    """A class that holds more is several components sharing state (docs/architecture.md)."""
    import ast

    big = {}
    for path in (ROOT / "flowrl" / "runtime").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            name = f"{path.relative_to(ROOT)}:{node.name}" if isinstance(node, ast.ClassDef) else None
            if name and name not in RECORDS and len(names := _attributes(node)) > 15:
                big[name] = len(names)
    assert big == {}


def test_the_attribute_count_sees_assignments_tuples_and_fields():
    import ast

    cls = ast.parse("class A:\n    x: int\n    def f(self):\n        self.a, self.b = 1, 2\n        self.c += 1\n"
                    "        other.d = 3\n").body[0]
    assert _attributes(cls) == {"x", "a", "b", "c"}
