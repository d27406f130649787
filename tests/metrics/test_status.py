"""`flowrl status RUN_DIR`: the live state of a run, read from another process."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time

from flowrl.metrics import read_status, show_status, write_status
from flowrl.metrics.status import STATUS_FILE


def test_show_status_prints_the_state_the_controller_wrote(synthetic_runs):
    out = io.StringIO()
    assert show_status(synthetic_runs["actor_bound"], stream=out) == 0
    text = out.getvalue()
    assert "finished" in text and "step 30/30" in text and "actor" in text


def test_write_status_is_atomic_json_and_round_trips(tmp_path):
    path = write_status(tmp_path, {"step": 3, "reward_mean": float("nan"), "nodes": []},
                        phase="running", graph={"name": "ppo", "nodes": ["rollout"]})
    assert path.name == STATUS_FILE and not list(tmp_path.glob(".*tmp"))
    doc = read_status(tmp_path)
    assert doc["step"] == 3 and doc["reward_mean"] is None and doc["phase"] == "running"
    assert doc["graph"]["nodes"] == {"rollout": 1}
    json.loads(path.read_text())


def test_show_status_without_a_status_file_says_so_and_exits_1(tmp_path):
    out = io.StringIO()
    assert show_status(tmp_path, stream=out) == 1
    assert "status.json not found" in out.getvalue()


def test_a_running_status_whose_controller_is_gone_reads_stale_and_exits_2(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)  # a pid that no longer runs
    write_status(tmp_path, {"step": 1}, phase="running", pid=child.pid)
    doc = read_status(tmp_path)
    doc["written_t"] = time.time() - 60
    (tmp_path / STATUS_FILE).write_text(json.dumps(doc))
    out = io.StringIO()
    assert show_status(tmp_path, stream=out) == 2
    assert "stale" in out.getvalue() and "gone" in out.getvalue()
