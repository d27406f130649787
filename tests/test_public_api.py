"""The public API is small and stable; built-in nodes use nothing else (as a user's node would)."""

import ast
import subprocess
import sys
from pathlib import Path

import flowrl

ROOT = Path(__file__).resolve().parents[1]


def test_public_api_is_exactly_the_documented_names():
    assert sorted(flowrl.__all__) == sorted([
        "Batch", "FlowrlError", "GraphError", "GraphSpec", "Join", "Node", "NodeConfig", "NodeContext",
        "Sink", "Source", "Ticket", "load_graph", "run", "Drop", "Observer", "Ragged", "scale",
    ])
    for name in flowrl.__all__:
        assert getattr(flowrl, name) is not None


def test_builtin_nodes_import_only_the_public_api_and_pure_libraries():
    allowed = ("flowrl", "flowrl.models", "flowrl.tasks", "flowrl.rl", "flowrl.nodes")
    for path in (ROOT / "nodes").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("flowrl"):
                assert node.module.startswith(allowed) and not node.module.startswith("flowrl.runtime"), \
                    f"{path.name} imports {node.module}"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith("flowrl.runtime"), f"{path.name} imports {alias.name}"


def test_import_flowrl_and_loading_graphs_do_not_import_torch():
    code = ("import sys, flowrl; from flowrl.graph import load_graph; load_graph('graphs/ppo.yaml'); "
            "load_graph('graphs/grpo.yaml'); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_flowrl_help_answers_without_importing_torch():
    code = "import sys; from flowrl.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "run" in out.stdout and out.stdout.strip().endswith("False"), out.stderr


def test_every_package_folder_is_listed_in_pyproject():
    text = (ROOT / "pyproject.toml").read_text()
    for init in (ROOT / "flowrl").glob("*/__init__.py"):
        assert f'"flowrl.{init.parent.name}"' in text, f"flowrl.{init.parent.name} missing from pyproject packages"
    assert '"flowrl.nodes"' in text
