"""`flowrl status RUN_DIR --dump`: every node process of a running job (data-parallel ranks too)
writes its tasks' stacks, its channels' counters and its input queues into its log."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from flowrl.testing.harness import flowrl_command, kill_group, read_jsonl

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]

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


HANGS = f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  stuck: {{kind: "tests.graph.kinds:HangsInSetup", on_failure: {{policy: fail}}}}
  collect: {{kind: "{N}:Collect"}}
edges: [numbers -> stuck, stuck -> collect]
schedule: {{steps: 4, batch_size: 2}}
supervision: {{startup_timeout_s: 4}}
"""


def test_a_process_that_never_reports_ready_leaves_where_it_hung_in_its_log(tmp_path):
    """Its setup never returns; before the supervisor stops it, every thread's stack goes into its
    log (faulthandler, from the signal handler: its compute thread waits in C)."""
    from flowrl.testing import run_graph

    (tmp_path / "g.yaml").write_text(HANGS)
    result = run_graph(tmp_path / "g.yaml", tmp_path / "run", timeout_s=90, cwd=ROOT)
    assert result.exit_code == 1 and "did not report READY within 4 s" in result.stderr, result.stderr[-2000:]
    log = (tmp_path / "run" / "logs" / "stuck.0.0.log").read_text()
    assert "most recent call first" in log and "in setup" in log, log[-3000:]


GROUP_HANGS = f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  follow: {{kind: "{N}:Follower"}}
  train: {{kind: "tests.graph.kinds:TrainerHangsInSetup", devices: 2, on_failure: {{max_restarts: 1, backoff_s: 0.1}}}}
edges: [numbers -> follow, follow -> train]
weights: [train -> follow]
schedule: {{steps: 4, batch_size: 2}}
supervision: {{startup_timeout_s: 6}}
"""


def test_a_rank_that_hangs_in_setup_while_its_group_waits_leaves_where_it_hung_in_its_log(tmp_path):
    """Rank 1 of a two-rank trainer never finishes setup; rank 0 waits for it in the first weight
    snapshot's gather, so neither reports READY. The leader is found first and takes its group
    down: the ranks still starting write their stacks before they are stopped (rank 1 too, though
    the failure is the leader's)."""
    from flowrl.testing import run_graph

    (tmp_path / "g.yaml").write_text(GROUP_HANGS)
    result = run_graph(tmp_path / "g.yaml", tmp_path / "run", timeout_s=90, cwd=ROOT)
    assert result.exit_code == 1 and "did not report READY" in result.stderr, result.stderr[-2000:]
    logs = tmp_path / "run" / "logs"
    for rank in (0, 1):
        log = (logs / f"train.0.{rank}.log").read_text()
        assert "most recent call first" in log, (rank, log[-3000:])
    assert "in setup" in (logs / "train.0.1.log").read_text()


def test_a_run_the_harness_kills_at_its_timeout_says_where_each_process_waited(tmp_path):
    """`run_graph` asks every node process for its state before the kill: a test that fails on a
    hang then names the process that held the run, and what the others waited for."""
    from flowrl.testing import run_graph

    (tmp_path / "g.yaml").write_text(GRAPH)
    run_dir = tmp_path / "run"
    # norm never returns from its first call; process_timeout_s (600 s) and the tickets' 120 s are far off
    result = run_graph(tmp_path / "g.yaml", run_dir, faults=["stall:norm@step=0"], timeout_s=30, cwd=ROOT)
    assert result.exit_code == -9
    lines = result.stderr[result.stderr.index("killed after 30"):].splitlines()[1:]
    by_proc = {line.split(":")[0].strip(): line for line in lines}
    assert set(by_proc) == {p.replace(".", "/") for p in PROCS}, result.stderr[-3000:]
    norm = by_proc["norm/0/0"]
    assert "busy t-000000 for" in norm and "main loop in on_arrival" in norm, norm  # inside its first call
    assert "busy no" in by_proc["collect/0/0"], by_proc["collect/0/0"]  # waiting for norm's output
    assert "main_loop" in (run_dir.parent / "run.hang.txt").read_text()  # the whole dumps
