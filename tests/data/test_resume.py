"""A run killed midway and resumed sees every dataset row exactly once per epoch (real processes)."""

import json
import os
import signal
import subprocess
import time

import pytest

from flowrl.testing.harness import flowrl_command, kill_group, run_graph

GRAPH = """
name: seen
seed: 3
nodes:
  dataset:
    kind: dataset
    config: {{path: {path}, template: "{{question}}=", model: {{type: tiny, vocab_size: 102}}, max_new_tokens: 2}}
  sink:
    kind: tests.data.nodes:SeenRows
    config: {{seconds: 0.05}}
edges:
  - dataset -> sink
schedule: {{steps: {steps}, batch_size: {batch}, max_staleness: 0, checkpoint_every: 4}}
"""


@pytest.mark.timeout(150)
def test_a_killed_and_resumed_run_sees_every_row_once_per_epoch(tmp_path):
    rows, batch, steps = 18, 4, 24  # 96 prompts: 5 full epochs and a part; epochs straddle tickets
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+0", "answer": str(i)}) + "\n" for i in range(rows)))
    graph = tmp_path / "g.yaml"
    graph.write_text(GRAPH.format(path=data, steps=steps, batch=batch))
    run_dir = tmp_path / "run"
    root = os.getcwd()
    proc = subprocess.Popen(flowrl_command(graph, run_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, cwd=root)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            latest = run_dir / "checkpoints" / "latest.json"
            if latest.exists() and json.loads(latest.read_text())["step"] >= 8:
                break
            time.sleep(0.05)  # polling progress on disk, not ordering events
        else:
            pytest.fail(f"no checkpoint at step 8 within 90 s: {proc.stderr.read1().decode()[-2000:]}")
        os.kill(proc.pid, signal.SIGKILL)  # the controller dies; its node processes notice and exit
        proc.wait(timeout=10)
    finally:
        kill_group(proc.pid)
        proc.wait()
    assert json.loads((run_dir / "checkpoints" / "latest.json").read_text())["step"] < steps, "killed too late"
    result = run_graph(None, run_dir, extra=["--resume", str(run_dir)], timeout_s=100, cwd=root)
    assert result.exit_code == 0, result.stderr[-3000:]
    seen = json.loads((run_dir / "seen_rows.json").read_text())
    assert len(seen) == steps * batch  # nothing lost, nothing trained on twice
    for epoch in range(len(seen) // rows):
        assert sorted(seen[epoch * rows:(epoch + 1) * rows]) == list(range(rows)), f"epoch {epoch}"
    tail = seen[(len(seen) // rows) * rows:]
    assert len(set(tail)) == len(tail)
