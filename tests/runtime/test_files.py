"""What a run leaves on disk: private to its user, and nothing stale from runs that died."""

import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from flowrl.runtime.controller.controller import make_sockdir

pytestmark = pytest.mark.timeout(120)
N = "flowrl.testing.nodes"


def test_a_run_directory_and_its_files_are_readable_by_their_owner_only(tmp_path):
    g = tmp_path / "g.yaml"
    g.write_text(f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  collect: {{kind: "{N}:Collect"}}
edges: [numbers -> collect]
schedule: {{steps: 3, batch_size: 2}}
""")
    out = subprocess.run([sys.executable, "-m", "flowrl", "run", str(g), "--run-dir", str(tmp_path / "run"), "--quiet"],
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    run = tmp_path / "run"
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    files = [p for p in run.rglob("*") if p.is_file()]
    assert files and all(stat.S_IMODE(p.stat().st_mode) & 0o077 == 0 for p in files), \
        [(p.name, oct(p.stat().st_mode)) for p in files if p.stat().st_mode & 0o077]


def test_socket_folders_of_runs_whose_controller_died_are_removed_by_the_next_run():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = Path(tempfile.mkdtemp(prefix="flowrl-"))
    (stale / "pid").write_text(str(dead.pid))
    (stale / "control").write_text("")
    alive = Path(tempfile.mkdtemp(prefix="flowrl-"))
    (alive / "pid").write_text(str(os.getpid()))
    mine = make_sockdir()
    try:
        assert not stale.exists() and alive.exists() and mine.exists()
        assert stat.S_IMODE(mine.stat().st_mode) == 0o700
    finally:
        import shutil

        for d in (alive, mine, stale):
            shutil.rmtree(d, ignore_errors=True)
