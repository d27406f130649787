"""A command that needs an optional extra which is not installed names the extra and the install
command (exit 2), never a traceback. The real CLI runs in a subprocess in which the package is
missing: a `sitecustomize` puts None in sys.modules for it, which is what Python's import does
for a package that is not there (ModuleNotFoundError, find_spec None)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl import cli
from flowrl.graph import GraphSpec, NodeSpec
from flowrl.placement.extras import MODULE_EXTRA, extra_for, graph_needs

ROOT = Path(__file__).resolve().parents[1]
HIDE = "import os, sys\nfor n in filter(None, os.environ['HIDE_MODULES'].split(',')):\n    sys.modules[n] = None\n"


def without(tmp_path, modules: str, *args: str) -> subprocess.CompletedProcess:
    """`flowrl ARGS` in a Python where `modules` (comma-separated) are not installed."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(HIDE)
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{ROOT}", HIDE_MODULES=modules, COLUMNS="120")
    return subprocess.run([sys.executable, "-m", "flowrl", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def says(r: subprocess.CompletedProcess, extra: str) -> None:
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"pip install 'flowrl[{extra}]'" in r.stdout + r.stderr and "Traceback" not in r.stdout + r.stderr


@pytest.mark.timeout(180)
def test_export_hf_without_transformers_names_the_hf_extra(tmp_path):
    from tests.export.test_export import fake_run

    fake_run(tmp_path / "run", {"type": "tiny", "d_model": 16, "n_layers": 1, "n_heads": 2})
    r = without(tmp_path, "transformers", "export", str(tmp_path / "run"), "--hf", str(tmp_path / "out"))
    says(r, "hf")
    assert "flowrl export needs the 'hf' extra (transformers is not installed)" in r.stderr
    assert not (tmp_path / "out" / "config.json").exists()


@pytest.mark.timeout(120)
def test_report_without_matplotlib_names_the_report_extra(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    says(without(tmp_path, "matplotlib", "report", str(tmp_path / "run")), "report")


@pytest.mark.timeout(120)
def test_a_ray_launch_without_ray_stops_before_starting_anything(tmp_path):
    r = without(tmp_path, "ray", "run", "graphs/ppo.yaml", "launcher.type=ray", "--run-dir", str(tmp_path / "run"))
    says(r, "ray")
    assert "`launcher` uses `type: ray`" in r.stderr and not (tmp_path / "run").exists()
    inventory = without(tmp_path, "ray", "check", "graphs/ppo.yaml", "--inventory", "ray")
    assert inventory.returncode == 2 and "[ray]" in inventory.stderr and "Traceback" not in inventory.stderr


@pytest.mark.timeout(120)
def test_a_vllm_graph_without_vllm_stops_run_and_is_a_note_in_check(tmp_path):
    r = without(tmp_path, "vllm", "run", "graphs/grpo-vllm.yaml", "--run-dir", str(tmp_path / "run"))
    says(r, "vllm")
    assert "node `rollout` uses engine `vllm`" in r.stderr and not (tmp_path / "run").exists()
    check = without(tmp_path, "vllm", "check", "graphs/grpo-vllm.yaml")
    assert check.returncode == 0 and "extra-missing" in check.stdout and "pip install 'flowrl[vllm]'" in check.stdout
    declared = without(tmp_path, "vllm", "check", "graphs/grpo-vllm.yaml", "--inventory",
                       "examples/inventories/laptop-2cpu.yaml")  # another machine's devices: it may have vLLM
    assert declared.returncode == 0 and "extra-missing" not in declared.stdout


@pytest.mark.parametrize("module, extra", sorted(MODULE_EXTRA.items()))
def test_every_optional_module_maps_to_its_extra_in_any_command(monkeypatch, capsys, module, extra):
    def dispatch(args):
        try:
            __import__(module)
        except ImportError as e:
            raise ImportError(f"something needs {module}") from e
        raise AssertionError("hidden module imported")

    monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.setattr(cli, "_dispatch", dispatch)
    for command in (["status", "x"], ["check", "g.yaml"]):
        assert cli.main(command) == 2
        err = capsys.readouterr().err
        assert f"flowrl {command[0]} needs the '{extra}' extra ({module} is not installed): " \
               f"pip install 'flowrl[{extra}]'" in err


def test_an_import_error_of_no_extra_stays_an_internal_error_in_check(monkeypatch, capsys, tmp_path):
    import tempfile

    def dispatch(args):
        raise ModuleNotFoundError("No module named 'flowrl.gone'", name="flowrl.gone")

    monkeypatch.setattr(cli, "_dispatch", dispatch)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert cli.main(["check", "g.yaml"]) == 70 and "bug in flowrl" in capsys.readouterr().err
    assert extra_for(ModuleNotFoundError("x", name="zmq")) is None


def test_flowrls_own_import_errors_that_name_an_extra_are_read_too():
    try:
        try:
            raise ModuleNotFoundError("No module named 'wandb'", name="wandb")
        except ImportError:
            raise ImportError("metrics.wandb needs the wandb package: pip install 'flowrl[logging]'") from None
    except ImportError as e:
        assert extra_for(e) == ("wandb", "logging")  # found through __context__ despite `from None`
    assert extra_for(ImportError("needs pip install 'flowrl[gym]'")) == ("", "gym")


def test_a_graph_names_every_extra_it_uses():
    spec = GraphSpec(nodes={
        "rollout": NodeSpec(kind="rollout", config={"engine": {"type": "vllm"}, "model": {"type": "hf", "path": "m"}}),
        "actor": NodeSpec(kind="actor", config={"train": {"lora": {"r": 8}}})})
    assert {(n.where, n.module, n.extra) for n in graph_needs(spec)} == {
        ("node `rollout`", "vllm", "vllm"), ("node `rollout`", "transformers", "hf"), ("node `actor`", "peft", "lora")}


def test_under_the_ray_launcher_only_what_runs_here_must_be_installed(monkeypatch):
    from flowrl.placement.extras import missing

    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setitem(sys.modules, "ray", None)
    nodes = {"rollout": NodeSpec(kind="rollout", config={"engine": {"type": "vllm"}})}
    assert [n.module for n in missing(GraphSpec(nodes=nodes))] == ["vllm"]
    assert [n.module for n in missing(GraphSpec(nodes=nodes, launcher={"type": "ray"}))] == ["ray"]
