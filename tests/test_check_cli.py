"""`flowrl check`, run as the real command in a subprocess: exit codes 0/1/2, JSON shape, no heavy
import and no process started (what keeps it fast), and no torch import."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INV = "examples/inventories/"


def flowrl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    exe = shutil.which("flowrl")
    cmd = [exe] if exe else [sys.executable, "-m", "flowrl"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="120")
    return subprocess.run([*cmd, "check", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_shipped_graph_plans_with_exit_0_and_prints_the_table():
    r = flowrl("graphs/ppo.yaml")
    assert r.returncode == 0, r.stdout + r.stderr
    for word in ("node", "rank", "actor", "critic", "rollout", "ok"):
        assert word in r.stdout


def test_json_output_has_the_contract_shape():
    r = flowrl("examples/gpu/ppo-a100x8.yaml", "--inventory", INV + "a100x8-nvlink.yaml", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert set(data) == {"plan", "findings", "memory"} and data["findings"] == []
    entry = data["plan"][0]
    for key in ("node", "replica", "rank", "host", "devices", "local_devices"):
        assert key in entry
    actor = [e for e in data["plan"] if e["node"] == "actor"]
    assert [e["devices"] for e in actor] == [[0], [1], [2], [3]] and actor[0]["mesh"] == [2, 2]


def test_errors_give_exit_1_with_code_node_and_devices_in_json():
    r = flowrl("examples/wrong/overlap.yaml", "--inventory", INV + "a100x8-nvlink.yaml", "--json")
    assert r.returncode == 1, r.stderr
    findings = json.loads(r.stdout)["findings"]
    assert {(f["severity"], f["code"], f["node"]) for f in findings} == {
        ("error", "overlap-forbidden", "reference"), ("error", "overlap-forbidden", "reward")}
    assert all(f["devices"] and "Fix:" in f["message"] for f in findings)


def test_errors_are_printed_in_the_table_view_too():
    r = flowrl("examples/wrong/busy-gpus.yaml", "--inventory", INV + "busy4.yaml")
    assert r.returncode == 1
    assert "device-busy" in r.stdout and "pid 41007" in r.stdout


def test_overrides_apply_before_planning():
    r = flowrl("graphs/ppo.yaml", "nodes.actor.devices=[5]", "--inventory", INV + "laptop-2cpu.yaml", "--json")
    assert r.returncode == 1
    assert [f["code"] for f in json.loads(r.stdout)["findings"] if f["severity"] == "error"] == ["device-not-visible"]


@pytest.mark.parametrize("args, where", [
    (("no/such/graph.yaml",), "no/such/graph.yaml"),
    (("graphs/ppo.yaml", "--inventory", "no/such/inventory.yaml"), "no/such/inventory.yaml"),
    (("graphs/ppo.yaml", "nodes.actor.replicas=0"), "replicas"),
])
def test_unloadable_graph_or_inventory_gives_exit_2_without_traceback(args, where):
    r = flowrl(*args)
    assert r.returncode == 2
    assert where in r.stderr and "Traceback" not in r.stderr + r.stdout


def test_inventory_with_a_typo_names_file_and_line(tmp_path):
    bad = tmp_path / "inv.yaml"
    bad.write_text("hosts:\n  - name: h\n    gpus:\n      - {id: 0, memroy_gb: 80}\n")
    r = flowrl("graphs/ppo.yaml", "--inventory", str(bad))
    assert r.returncode == 2 and f"{bad}:4" in r.stderr and "memory_gb" in r.stderr


# What a run loads and `flowrl check` must not: each costs from a tenth of a second to several seconds
HEAVY = ("torch", "numpy", "transformers", "vllm", "datasets", "pyarrow", "ray", "zmq")


def test_check_is_fast_it_loads_nothing_heavy_and_starts_no_process():
    """Fast means light: the check reads, plans and prints in this process. (Its time, cold, is
    measured by benchmarks/check_speed.py: under 2 s on an idle machine.)"""
    code = ("import sys, io, contextlib\n"
            "started = []\n"
            "sys.addaudithook(lambda event, args: started.append(event) if event in\n"
            "                 ('subprocess.Popen', 'os.fork', 'os.forkpty', 'os.posix_spawn', 'os.exec', 'os.spawn',\n"
            "                  'os.system', 'pty.spawn') else None)\n"
            "from flowrl.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    rc = main(['check', 'graphs/ppo.yaml'])\n"
            f"heavy = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))\n"
            "print(rc, heavy, started)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.stdout.strip() == "0 [] []", r.stdout + r.stderr


def test_check_never_imports_torch():
    code = ("import sys, io, contextlib\n"
            "from flowrl.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    rc = main(['check', 'graphs/ppo.yaml'])\n"
            "    main(['check', 'examples/wrong/overlap.yaml', '--inventory', 'examples/inventories/a100x8-nvlink.yaml', '--json'])\n"
            "heavy = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\n"
            "print(rc, heavy)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.stdout.strip() == "0 []", r.stdout + r.stderr


def test_an_internal_error_exits_70_says_it_is_a_bug_and_saves_the_traceback(monkeypatch, tmp_path, capsys):
    import tempfile

    from flowrl import cli
    from flowrl.placement import check

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a flowrl bug")

    monkeypatch.setattr(check, "check_graph", broken)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert cli.main(["check", "graphs/ppo.yaml"]) == cli.EXIT_INTERNAL == 70
    err = capsys.readouterr().err
    assert "internal error: ZeroDivisionError: a flowrl bug" in err and "bug in flowrl" in err
    (saved,) = tmp_path.glob("flowrl-check-internal-error-*.txt")
    assert str(saved) in err and "Traceback" in saved.read_text() and "broken" in saved.read_text()


def test_an_internal_error_in_run_saves_the_traceback_in_the_run_dir(monkeypatch, tmp_path, capsys):
    from flowrl import cli
    from flowrl.runtime.controller import run

    def broken(args):
        raise KeyError("plan")

    monkeypatch.setattr(run, "run_main", broken)
    assert cli.main(["run", "graphs/ppo.yaml", "--run-dir", str(tmp_path)]) == 70
    (saved,) = tmp_path.glob("flowrl-run-internal-error-*.txt")
    assert str(saved) in capsys.readouterr().err


def test_help_documents_the_exit_codes():
    r = subprocess.run([sys.executable, "-m", "flowrl", "check", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert "70" in r.stdout and "internal error" in r.stdout and "cannot be used" in r.stdout


def test_graph_files_in_utf_16_load_and_latin_1_is_exit_2_with_the_fix(tmp_path):
    text = (ROOT / "graphs/ppo.yaml").read_text()
    utf16 = tmp_path / "ppo16.yaml"
    utf16.write_bytes(text.encode("utf-16"))
    assert flowrl(str(utf16), "--json").returncode == 0
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(text.replace("name: ppo", "name: café").encode("latin-1"))
    r = flowrl(str(latin))
    assert r.returncode == 2 and "save the file as UTF-8" in r.stderr and "Traceback" not in r.stderr


def test_check_shows_colocated_memory_as_the_larger_turn_and_says_when_even_that_is_too_much():
    fits = flowrl("examples/wrong/turns-too-big.yaml", "nodes.actor.model_size=7B", "nodes.rollout.model_size=7B",
                  "--inventory", INV + "a100x8-nvlink.yaml")
    assert fits.returncode == 0, fits.stdout + fits.stderr
    assert ("GPU 0, 1: max(rollout 32.0 GiB, actor 53.2 GiB) turns + 1.0 GiB asleep (CUDA context) = 54.2 GiB of 80 GiB "
            "(68%) (summed: 85.2 GiB)") in fits.stdout
    summed = flowrl("examples/wrong/turns-too-big.yaml", "nodes.actor.model_size=7B", "nodes.rollout.model_size=7B",
                    "nodes.rollout.take_turns=false", "--inventory", INV + "a100x8-nvlink.yaml", "--json")
    assert summed.returncode == 1
    (error,) = [f for f in json.loads(summed.stdout)["findings"] if f["severity"] == "error"]
    assert error["code"] == "memory-exceeded" and error["node"] == "actor" and error["devices"] == [0, 1]
    assert "rollout 32.0 GiB + actor 53.2 GiB = 85.2 GiB" in error["message"] and "take_turns: true" in error["message"]
    too_big = flowrl("examples/wrong/turns-too-big.yaml", "--inventory", INV + "a100x8-nvlink.yaml")
    assert too_big.returncode == 1 and "memory-exceeded" in too_big.stdout
    assert "max(rollout 32.0 GiB, actor 105.3 GiB) turns" in too_big.stdout
