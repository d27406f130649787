"""`flowrl run graphs/ppo.yaml launcher.type=ray` with no cluster running: the launcher starts a
private Ray cluster on loopback, runs every node process under it, and stops it at the end."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from flowrl.testing import audit_ledger, read_jsonl
from flowrl.testing.harness import flowrl_command, kill_group
from tests.ray.conftest import alive, is_loopback, listening
from tests.ray.test_launcher import node_processes, wait_for

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ppo_under_the_ray_launcher_starts_a_loopback_cluster_finishes_and_leaves_nothing(tmp_path):
    import psutil

    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}
    cmd = flowrl_command(ROOT / "graphs" / "ppo.yaml", run_dir, overrides=["launcher.type=ray", f"schedule.steps={STEPS}"])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=env, cwd=ROOT)
    try:
        wait_for(lambda: len(node_processes(run_dir)) == 6, 200, "the six node processes of graphs/ppo.yaml")
        tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        sockets = listening([proc.pid, *tree])
        session = {m.group(1) for p in tree for m in [re.search(r"--log_dir=(/\S*?/frl-ray-[^/]+)/", " ".join(
            _cmdline(p)))] if m}
        out, err = proc.communicate(timeout=240)
    finally:
        kill_group(proc.pid)
        proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert "starting a private Ray cluster on 127.0.0.1" in out
    assert re.search(r"Ray cluster 127\.0\.0\.1:\d+ up, 1 node\(s\) at 127\.0\.0\.1\n", out), out  # ray.nodes()
    names = {name for _, name, _ in sockets}
    assert {"gcs_server", "raylet"} <= names, names
    assert [s for s in sockets if not is_loopback(s[2])] == []
    audit = audit_ledger(read_jsonl(run_dir / "ledger.jsonl"))
    assert audit.exactly_once and len(audit.issued) >= STEPS
    assert alive(tree) == []  # Ray's processes, the actors and the node processes: all gone
    assert len(session) == 1 and not Path(session.pop()).exists()  # its temp folder too


def _cmdline(pid: int) -> list[str]:
    import psutil

    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []
