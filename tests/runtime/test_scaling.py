"""Elastic replicas: `flowrl scale` adds and removes replicas of a stateless node mid-run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

import flowrl
from flowrl.runtime.controller.scaling import ScaleError
from flowrl.testing import read_jsonl
from flowrl.testing.harness import flowrl_command, kill_group

pytestmark = pytest.mark.timeout(180)
N = "flowrl.testing.nodes"
GRAPH = f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  scale: {{kind: "{N}:Scale", config: {{delay_s: 0.15}}}}
  collect: {{kind: "{N}:Chain"}}
edges: [numbers -> scale, scale -> collect]
schedule: {{steps: 50, batch_size: 2, max_staleness: 8, checkpoint_every: 10}}
supervision: {{heartbeat_s: 0.2, deadline_s: 3.0}}
"""


def completed(run_dir: Path) -> int:
    return sum(1 for r in read_jsonl(run_dir / "ledger.jsonl") if r["event"] == "completed")


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)  # polling progress on disk, not ordering events
    pytest.fail(f"timed out waiting for {what}")


def test_replicas_added_and_removed_mid_run_take_work_and_lose_none(tmp_path):
    (tmp_path / "g.yaml").write_text(GRAPH)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(flowrl_command(tmp_path / "g.yaml", run_dir), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for(lambda: completed(run_dir) >= 5, 90, "5 steps")
        with pytest.raises(ScaleError, match="stateful"):
            flowrl.scale(run_dir, "collect", 2)
        assert flowrl.scale(run_dir, "scale", 3) == "scale: 1 -> 3 replica(s)"
        logs = [run_dir / "logs" / f"scale.{r}.0.log" for r in (1, 2)]
        wait_for(lambda: all(p.exists() and "first batch" in p.read_text() for p in logs), 60,
                 "the new replicas' first batches")
        out = subprocess.run([sys.executable, "-m", "flowrl", "scale", str(run_dir), "scale=1"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "3 -> 1" in out.stdout, out.stderr
        stdout, stderr = proc.communicate(timeout=150)
    finally:
        kill_group(proc.pid)
        proc.wait()
    assert proc.returncode == 0, stderr[-2000:]
    rows = read_jsonl(run_dir / "ledger.jsonl")
    from flowrl.testing import audit_ledger

    assert audit_ledger(rows, ["collect"]).exactly_once
    scaled = [(r["was"], r["replicas"]) for r in rows if r["event"] == "scaled"]
    assert scaled == [(1, 3), (3, 1)]
    assert not (run_dir / "control.json").exists()  # the run is over: nobody to ask
    assert json.loads((run_dir / "checkpoints" / "latest.json").read_text())["step"] == 50
