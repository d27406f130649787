"""What the local fork server imports before it forks (`flowrl.Node.preload`): each node class's
modules, plus torch where the runtime needs it in a node process (checkpoints, torch.distributed);
a graph whose nodes never touch torch does not import it, and a node that does later gets the
plan's thread count all the same."""

from __future__ import annotations

import json

import pytest

from flowrl.graph import load_graph
from flowrl.placement import get_inventory, make_plan
from flowrl.runtime.controller.run import preload_modules
from flowrl.testing import run_graph

pytestmark = pytest.mark.timeout(180)

M = "tests.runtime.preload_nodes"
N = "flowrl.testing.nodes"


def graph(tmp_path, source: str, sink: str) -> str:
    path = tmp_path / "g.yaml"
    path.write_text(f"""\
nodes:
  source: {{kind: "{source}"}}
  sink: {{kind: "{sink}", devices: 1, config: {{out: "{tmp_path / 'held.json'}"}}}}
edges: [source -> sink]
schedule: {{steps: 3, batch_size: 2}}
""")
    return path


@pytest.mark.parametrize("sink,held", [
    ("Modules", ["tabnanny"]),                          # nothing needs torch
    ("StatefulModules", ["torch", "tabnanny"]),         # checkpoints do (torch.save)
    ("DefaultModules", ["torch", "torch._dynamo"]),     # flowrl.Node's default
])
def test_the_fork_server_imports_what_the_nodes_preload_and_torch_only_where_the_runtime_needs_it(tmp_path, sink, held):
    path = graph(tmp_path, f"{M}:Light", f"{M}:{sink}")
    result = run_graph(path, tmp_path / "run")
    assert result.exit_code == 0, result.stderr[-3000:]
    facts = json.loads((tmp_path / "held.json").read_text())
    assert facts["held"] == held
    assert facts["threads"] == 1, "torch imported after the fork still gets the plan's one core"
    assert facts["omp"] == "1"
    # a module that cannot be imported is named once, and the run goes on without it
    assert result.stderr.count("preloading 'flowrl_no_such_module' failed (ModuleNotFoundError") == 1


def test_preload_is_every_class_s_modules_once_with_torch_first_for_weights_ranks_and_checkpoints(tmp_path):
    def modules(nodes: str) -> list[str]:
        path = tmp_path / "p.yaml"
        path.write_text(f"nodes:\n{nodes}edges: [a -> b]\n")  # b a sink
        spec = load_graph(path)
        return preload_modules(spec, make_plan(spec, get_inventory(None)))

    assert modules(f'  a: {{kind: "{N}:Numbers"}}\n  b: {{kind: "{M}:Modules"}}\n') == ["tabnanny"]
    assert modules(f'  a: {{kind: "{M}:Light"}}\n  b: {{kind: "{M}:DefaultModules"}}\n') == [
        "flowrl_no_such_module", "torch", "torch._dynamo"]
    assert modules(f'  a: {{kind: "{N}:Numbers"}}\n  b: {{kind: "{N}:Collect"}}\n') == ["torch"]  # stateful
    assert modules(f'  a: {{kind: "{N}:Numbers"}}\n  b: {{kind: "{N}:Logger", devices: 2}}\n') == ["torch"]  # ranks
    assert modules(f'  a: {{kind: "{N}:Numbers"}}\n  b: {{kind: "{M}:Subscriber"}}\n') == ["torch"]  # weights
