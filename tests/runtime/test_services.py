"""Services (`services: [asker -> rollout]`) for real: an agent-like source asks two rollout replicas
for model turns, session by session, while the data edge carries the tickets. Fault-free, both
replicas serve and nothing restarts; kill -9 of a rollout replica with requests in flight, or of the
client mid-episode, loses and repeats no ticket (the ledger) and never hangs."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.testing import node_state, run_graph

pytestmark = pytest.mark.timeout(240)

N = "flowrl.testing.nodes"
STEPS, SIZE, TURNS = 4, 4, 2


def graph(tmp_path: Path, replicas: int = 2) -> Path:
    path = tmp_path / "graph.yaml"
    path.write_text(f"""\
nodes:
  asker: {{kind: "{N}:Asker", config: {{turns: {TURNS}, timeout_s: 100}}}}
  rollout:
    kind: rollout
    replicas: {replicas}
    config: {{model: {{type: tiny, d_model: 32, n_layers: 1, n_heads: 2}}, engine: {{type: builtin, continuous: true}},
             record_requests: true}}
  collect: {{kind: "{N}:ServedBy"}}
edges: [asker -> collect]
services: [asker -> rollout]
schedule: {{steps: {STEPS}, batch_size: {SIZE}, checkpoint_every: 1}}
supervision: {{heartbeat_s: 0.2}}
""")
    return path


def served(run_dir: Path) -> list[int]:
    seen = node_state(run_dir, "collect")["seen"]
    assert len(seen) == STEPS
    return [r for row in seen for r in row[2]]


def test_two_replicas_serve_every_session_with_no_restart(tmp_path):
    result = run_graph(graph(tmp_path), tmp_path / "run", timeout_s=200)
    assert result.exit_code == 0, result.stderr[-3000:]
    assert not [r for r in result.ledger if r["event"] == "node_down"]
    assert result.audit().exactly_once
    assert sorted(set(served(result.run_dir))) == [0, 1]  # least-loaded routing used both
    served_lines = [line for f in (result.run_dir / "served").glob("*.jsonl") for line in f.read_text().splitlines()]
    assert len(served_lines) == STEPS * SIZE * TURNS  # each request served once: nothing retried


@pytest.mark.parametrize("fault", ["kill:rollout/0@request=3", "kill:asker@request=5"])
def test_a_kill_mid_request_loses_and_repeats_no_ticket(tmp_path, fault):
    result = run_graph(graph(tmp_path), tmp_path / "run", faults=[fault], timeout_s=200)
    assert result.exit_code == 0, result.stderr[-3000:]
    downs = [r for r in result.ledger if r["event"] == "node_down"]
    assert [d["node"].split("/")[0] for d in downs] == [fault.split(":")[1].split("/")[0].split("@")[0]]
    audit = result.audit()
    assert audit.exactly_once, (audit.lost, audit.duplicated)
    # only the killed process went down: a rollout's requests in flight went to the other replica
    # (a client that had waited for them instead would have failed at its deadline, and gone down too)
    assert len(served(result.run_dir)) == STEPS * SIZE
