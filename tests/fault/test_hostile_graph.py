"""20,000 hostile messages from a stranger (and the libzmq abort bursts) into a running graph's
channels: no node restarts, no ticket is lost or counted twice, training goes on meanwhile. Then
an insider (a buggy producer that knows the run's secret: it hoards credit, replays, lies about
tensors): still no restart and no ticket lost, though while it hoards the node's credit the real
producer waits (links are capped at half the credit and reclaimed after 2 s idle)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from flowrl.testing import audit_ledger, read_jsonl
from flowrl.testing.harness import flowrl_command, kill_group

N = "flowrl.testing.nodes"
GRAPH = f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  norm: {{kind: "{N}:StrictNormalizer", config: {{delay_s: 0.05}}}}
  collect: {{kind: "{N}:Chain"}}
edges: [numbers -> norm, norm -> collect]
schedule: {{steps: 250, batch_size: 2, max_staleness: 2, checkpoint_every: 20}}
supervision: {{heartbeat_s: 0.2, deadline_s: 10.0}}  # beats come from a thread the traffic cannot block
"""


@pytest.mark.timeout(240)
def test_hostile_traffic_into_a_running_graph_restarts_nothing_and_loses_nothing(tmp_path):
    (tmp_path / "g.yaml").write_text(GRAPH)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(flowrl_command(tmp_path / "g.yaml", run_dir), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        spec = run_dir / "procs" / "norm.0.0.json"
        deadline = time.monotonic() + 90
        while not (spec.exists() and any(r["event"] == "completed" for r in read_jsonl(run_dir / "ledger.jsonl"))):
            assert time.monotonic() < deadline, "the run did not start"
            time.sleep(0.1)  # polling progress on disk, not ordering events
        info = json.loads(spec.read_text())
        address = info["inputs"]["in"]
        def hostile(count: int, *extra: str) -> None:
            out = subprocess.run([sys.executable, "-m", "flowrl.transport.hostile", address, "--count", str(count),
                                  "--bursts", "2", *extra], capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr[-2000:]

        def completed() -> int:
            return sum(r["event"] == "completed" for r in read_jsonl(run_dir / "ledger.jsonl"))

        before = completed()  # the ledger is written line by line: steps counted before and after it sent
        hostile(20_000)
        during = completed() - before
        hostile(4_000, "--secret-hex", info["secret"].encode().hex())
        stdout, stderr = proc.communicate(timeout=150)
    finally:
        kill_group(proc.pid)
        proc.wait()
    assert proc.returncode == 0, stderr[-2000:]
    rows = read_jsonl(run_dir / "ledger.jsonl")
    assert audit_ledger(rows, ["collect"]).exactly_once
    assert not [r for r in rows if r["event"] in ("node_down", "recovery")]
    assert during >= 2, "training stopped while the stranger sent"  # more than the step in flight as it began
