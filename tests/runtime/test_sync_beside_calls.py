"""A trainer serves a weight sync while a call of its own runs (flowrl/runtime/worker/syncs.py,
`serve_lane`): a sync order that waited for the running call would leave the rollout idle for a
whole training step with `max_staleness >= 1`. Here the trainer's call for each batch returns only
once the subscriber holds the trainer's current version, so the run ends only if syncs are served
beside calls (before, it failed after `wait_s`)."""

import pytest

from flowrl.testing import run_graph

pytestmark = pytest.mark.timeout(150)
N = "flowrl.testing.nodes"


def test_a_trainer_serves_syncs_while_it_trains(tmp_path):
    held = tmp_path / "held"
    graph = tmp_path / "g.yaml"
    graph.write_text(f"""
name: beside
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  follower: {{kind: "{N}:HeldVersion", config: {{held_file: "{held}"}}}}
  trainer: {{kind: "{N}:TrainsWhileServing", config: {{held_file: "{held}", wait_s: 30}}}}
edges: [numbers -> follower, follower -> trainer]
weights: [trainer -> follower]
schedule: {{steps: 8, batch_size: 2, max_staleness: 1}}
""")
    result = run_graph(graph, tmp_path / "run", timeout_s=120)
    assert result.exit_code == 0, result.stderr[-3000:]
    assert not [r for r in result.ledger if r["event"] == "restarted"], "a fault-free run restarted a node"
    consumed = [r for r in result.ledger if r["event"] == "consumed"]
    assert len(consumed) == 8
    assert int(held.read_text()) >= 7  # the subscriber took every version up to the last but one
