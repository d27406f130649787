"""The runtime for real: node processes, channels, scheduler, supervision — with synthetic nodes."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from flowrl.testing import audit_ledger, node_state, read_jsonl, run_graph
from flowrl.testing.harness import flowrl_command, kill_group

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
N = "flowrl.testing.nodes"

THREE_STAGE = f"""\
name: three
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  scale: {{kind: "{N}:Scale", replicas: REPLICAS, config: {{delay_s: DELAY}}}}
  collect: {{kind: "{N}:Collect"}}
edges:
  - numbers -> scale
  - scale -> collect
schedule: {{steps: STEPS, batch_size: 4, max_staleness: 3}}
supervision: {{heartbeat_s: 0.2, deadline_s: 3.0}}
"""


def graph(tmp_path: Path, text: str, **subs) -> Path:
    for k, v in subs.items():
        text = text.replace(k.upper(), str(v))
    path = tmp_path / "graph.yaml"
    path.write_text(text)
    return path


def compute_spans_by_process(run_dir: Path) -> dict[str, int]:
    import json

    events = json.loads((run_dir / "trace.json").read_text())
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    out: dict[str, int] = {}
    for e in events:
        if e.get("ph") == "X" and e["name"] == "compute":
            out[names[e["pid"]]] = out.get(names[e["pid"]], 0) + 1
    return out


def assert_exactly_once(result, steps):
    assert result.exit_code == 0, result.stderr[-3000:]
    audit = result.audit()
    assert audit.exactly_once, (audit.lost, audit.duplicated)
    assert len(audit.issued) == steps


def test_three_stage_pipeline_consumes_every_ticket_exactly_once(tmp_path):
    g = graph(tmp_path, THREE_STAGE, replicas=1, delay=0, steps=12)
    result = run_graph(g, tmp_path / "run", timeout_s=120)
    assert_exactly_once(result, 12)
    consumed = [r for r in result.ledger if r["event"] == "consumed"]
    assert [r["batch_id"] for r in consumed] == sorted(r["batch_id"] for r in consumed)  # in ticket order
    assert len(result.metrics) == 12 and result.metrics[-1]["step"] == 12
    for name in ("graph.yaml", "plan.json", "ledger.jsonl", "metrics.jsonl"):
        assert (tmp_path / "run" / name).exists(), name
    assert sorted(p.name for p in (tmp_path / "run" / "logs").iterdir()) == [
        "collect.0.0.log", "numbers.0.0.log", "scale.0.0.log"]


def test_fan_out_to_replicas_and_fan_in_spreads_work_and_loses_nothing(tmp_path):
    g = graph(tmp_path, THREE_STAGE, replicas=3, delay=0.05, steps=18)
    result = run_graph(g, tmp_path / "run", timeout_s=120)
    assert_exactly_once(result, 18)
    busy = compute_spans_by_process(tmp_path / "run")
    assert all(busy.get(f"scale/{r}", 0) > 0 for r in range(3)), busy  # every replica took work


def test_join_of_two_branches_gathers_each_batch_id_once(tmp_path):
    text = f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  left: {{kind: "{N}:Scale", config: {{factor: 2}}}}
  right: {{kind: "{N}:Scale", config: {{factor: 3}}}}
  pair: {{kind: "{N}:Pair"}}
  collect: {{kind: "{N}:Collect"}}
edges:
  - numbers -> left
  - numbers -> right
  - left -> pair.a
  - right -> pair.b
  - pair -> collect
schedule: {{steps: 8, batch_size: 3, max_staleness: 2}}
"""
    result = run_graph(graph(tmp_path, text), tmp_path / "run", timeout_s=120)
    assert_exactly_once(result, 8)
    state = node_state(tmp_path / "run", "collect", step=8)
    sums = {bid: s for bid, s in state["seen"]}
    for bid, s in sums.items():
        i = int(bid.rsplit("-", 1)[1])
        assert s == 5 * sum(range(i * 3, i * 3 + 3))  # (2x + 3x) summed


def test_killed_middle_node_is_restarted_and_its_tickets_replayed(tmp_path):
    g = graph(tmp_path, THREE_STAGE, replicas=1, delay=0.02, steps=12)
    result = run_graph(g, tmp_path / "run", faults=["kill:scale@step=4"], timeout_s=150)
    assert_exactly_once(result, 12)
    events = [r["event"] for r in result.ledger]
    assert "node_down" in events and "reissued" in events


def test_stopped_node_is_detected_as_hung_within_the_deadline_and_replaced(tmp_path):
    g = graph(tmp_path, THREE_STAGE, replicas=1, delay=0.02, steps=10)
    result = run_graph(g, tmp_path / "run", faults=["hang:scale@step=3"], timeout_s=150)
    assert_exactly_once(result, 10)
    down = [r for r in result.ledger if r["event"] == "node_down"]
    assert down and "hung" in down[0]["why"]


def test_node_that_raises_in_setup_fails_the_run_fast_with_its_error(tmp_path):
    text = THREE_STAGE.replace(f'"{N}:Scale", replicas: REPLICAS', f'"{N}:Scale", replicas: 1, '
                               'on_failure: {max_restarts: 1, backoff_s: 0}')
    g = graph(tmp_path, text, delay=0, steps=5)
    result = run_graph(g, tmp_path / "run", faults=["crash:scale,every"], timeout_s=120)
    assert result.exit_code == 1
    assert "scale" in result.stderr and "injected crash" in result.stderr
    assert "restart budget of 1" in result.stderr
    # fast: failed at its second failure in setup (the budget of 1 spent), before any ticket got through
    downs = [(r["node"], r["why"]) for r in result.ledger if r["event"] == "node_down"]
    assert downs == [("scale/0/0", "failed in setup")] * 2, downs
    assert [r["event"] for r in result.ledger if r["event"] in ("failed", "completed")] == ["failed"]


@pytest.mark.parametrize("k", [0, 1, 2])
def test_staleness_bound_holds_for_every_consumed_batch(tmp_path, k):
    text = f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  follower: {{kind: "{N}:Follower", config: {{delay_s: 0.03}}}}
  trainer: {{kind: "{N}:Trainer", config: {{delay_s: 0.05}}}}
edges:
  - numbers -> follower
  - follower -> trainer
weights:
  - trainer -> follower
schedule: {{steps: 10, batch_size: 2, max_staleness: {k}}}
"""
    result = run_graph(graph(tmp_path, text), tmp_path / "run", timeout_s=150)
    assert_exactly_once(result, 10)
    consumed = [r for r in result.ledger if r["event"] == "consumed"]
    assert all(0 <= r["staleness"] <= k for r in consumed), [r["staleness"] for r in consumed]
    if k == 0:
        assert all(r["policy_version"] == int(r["batch_id"][-6:]) for r in consumed)


def test_sigint_stops_every_process_and_leaves_no_socket_files(tmp_path):
    import psutil

    g = graph(tmp_path, THREE_STAGE, replicas=2, delay=0.2, steps=1000)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(flowrl_command(g, run_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(read_jsonl(run_dir / "metrics.jsonl")) < 2:
            time.sleep(0.1)  # polling a file for progress, not ordering events
        assert read_jsonl(run_dir / "metrics.jsonl"), "run made progress"
        children = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        sockdirs = {Path(c.split("ipc://", 1)[1]).parent for c in _ipc_addresses(run_dir)}
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, err[-2000:]
        gone_deadline = time.monotonic() + 10
        while time.monotonic() < gone_deadline and any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in children):
            time.sleep(0.05)
        assert not [p for p in children if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
        assert sockdirs and not any(d.exists() for d in sockdirs)
    finally:
        kill_group(proc.pid)
        proc.wait()


def _ipc_addresses(run_dir: Path) -> list[str]:
    import json

    out = []
    for f in (run_dir / "procs").glob("*.json"):
        spec = json.loads(f.read_text())
        out += [a for a in spec["inputs"].values() if a.startswith("ipc://")]
    return out


def test_custom_node_example_runs_with_flowrl_run(tmp_path):
    result = run_graph(ROOT / "examples" / "custom_node" / "graph.yaml", tmp_path / "run", cwd=ROOT, timeout_s=120)
    assert_exactly_once(result, len(audit_ledger(result.ledger).issued))


def test_graph_built_in_python_runs_with_flowrl_run(tmp_path):
    import flowrl
    from flowrl.graph import GraphSpec, NodeSpec

    spec = GraphSpec(
        name="py",
        nodes={"numbers": NodeSpec(kind=f"{N}:Numbers"), "scale": NodeSpec(kind=f"{N}:Scale"),
               "collect": NodeSpec(kind=f"{N}:Collect")},
        edges=["numbers -> scale", "scale -> collect"],
        schedule={"steps": 5, "batch_size": 2},
    )
    summary = flowrl.run(spec, run_dir=tmp_path / "run")
    assert summary.exit_code == 0
    assert audit_ledger(summary.ledger).exactly_once and len(summary.metrics) == 5


def test_node_killed_before_every_node_is_ready_does_not_block_the_start(tmp_path):
    text = THREE_STAGE.replace('collect: {kind: "' + N + ':Collect"}',
                               'collect: {kind: "' + N + ':Collect", config: {setup_delay_s: 1.0}}')
    text = text.replace("replicas: REPLICAS,", "replicas: 1, on_failure: {backoff_s: 3.0},")
    g = graph(tmp_path, text, delay=0, steps=6)
    # scale dies at once and comes back only after collect, the last to start, is ready: the
    # start must still happen when the replacement reports READY
    result = run_graph(g, tmp_path / "run", faults=["kill:scale@t=0.05"], timeout_s=120)
    assert_exactly_once(result, 6)
