"""`flowrl status RUN_DIR --dump`: every node process of a running job (data-parallel ranks too)
writes its tasks' stacks, its channels' counters and its input queues into its log."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from flowrl.testing.harness import flowrl_command, kill_group, read_jsonl

pytestmark = pytest.mark.timeout(120)

N = "flowrl.testing.nodes"
GRAPH = f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  norm: {{kind: "{N}:Normalizer", config: {{delay_s: 0.05}}}}
  collect: {{kind: "{N}:Collect", devices: 2}}
edges: [numbers -> norm, norm -> collect]
schedule: {{steps: 100000, batch_size: 2}}
"""
PROCS = ("numbers.0.0", "norm.0.0", "collect.0.0", "collect.0.1")


def _wait(what, fn, deadline, proc):
    while not fn():
        assert proc.poll() is None, f"the run exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_dump_writes_every_process_state_into_its_log(tmp_path):
    (tmp_path / "g.yaml").write_text(GRAPH)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(flowrl_command(tmp_path / "g.yaml", run_dir), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        _wait("the first completed ticket", lambda: (run_dir / "ledger.jsonl").exists() and any(
            r["event"] == "completed" for r in read_jsonl(run_dir / "ledger.jsonl")), deadline, proc)
        _wait("every pid file", lambda: all((run_dir / "procs" / f"{p}.pid").exists() for p in PROCS), deadline, proc)
        out = subprocess.run([sys.executable, "-m", "flowrl", "status", str(run_dir), "--dump"],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert "4 process(es)" in out.stdout, out.stdout
        logs = {p: run_dir / "logs" / f"{p}.log" for p in PROCS}
        _wait("a state dump in every log", lambda: all("state dump of" in path.read_text() for path in logs.values()),
              deadline, proc)
        norm = logs["norm.0.0"].read_text()
        assert "in order: watermark" in norm and "channel ChannelStats(name='norm.in'" in norm
        assert "task " in norm and "main_loop" in norm
        assert "channel ChannelStats(name='collect.rank1'" in logs["collect.0.1"].read_text()
        assert proc.poll() is None  # the dump costs the run nothing
    finally:
        kill_group(proc.pid)
        proc.wait(timeout=30)


def test_dump_of_a_folder_that_is_no_run_says_so(tmp_path):
    out = subprocess.run([sys.executable, "-m", "flowrl", "status", str(tmp_path), "--dump"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "no procs/ folder" in out.stderr


STUCK = f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  gsum: {{kind: "{N}:GroupSum", devices: 2}}
  collect: {{kind: "{N}:Collect"}}
edges: [numbers -> gsum, gsum -> collect]
schedule: {{steps: 100000, batch_size: 2}}
"""


def test_a_dump_while_a_rank_waits_in_a_collective_names_the_collective(tmp_path):
    """Rank 1 wedges in its third call (a stall: its compute thread sleeps); rank 0 then waits in the
    all-reduce for it. The node's compute runs off the event loop, so rank 0 still answers the dump,
    and says which collective it is in."""
    (tmp_path / "g.yaml").write_text(STUCK)
    run_dir = tmp_path / "run"
    cmd = flowrl_command(tmp_path / "g.yaml", run_dir, faults=["stall:gsum/0/1@step=2"])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    leader = run_dir / "logs" / "gsum.0.0.log"
    try:
        deadline = time.monotonic() + 90
        _wait("every pid file", lambda: all((run_dir / "procs" / f"gsum.0.{r}.pid").exists() for r in (0, 1)),
              deadline, proc)

        def named() -> bool:  # ask again until rank 0 is seen inside the all-reduce
            subprocess.run([sys.executable, "-m", "flowrl", "status", str(run_dir), "--dump"],
                           capture_output=True, text=True, timeout=30)
            return "compute thread: in collective all_reduce" in leader.read_text()

        _wait("rank 0's dump naming the all-reduce", named, deadline, proc)
        text = leader.read_text()
        dump = text[text.index("compute thread: in collective all_reduce"):]
        assert "process (nodes.py:" in dump.splitlines()[0]  # and where in the node it was called
        assert "task " in dump  # the loop answered while the compute thread waits
        assert "compute thread:" in (run_dir / "logs" / "gsum.0.1.log").read_text()
    finally:
        kill_group(proc.pid)
        proc.wait(timeout=30)
