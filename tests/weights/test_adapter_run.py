"""Adapter-only versions through a real run: trainer, followers and controller in their own processes."""

from __future__ import annotations

import os

import pytest

from flowrl.testing import run_graph
from tests.weights.conftest import ROOT

pytestmark = pytest.mark.timeout(240)
N, A = "flowrl.testing.nodes", "tests.weights.adapter_nodes"


@pytest.mark.parametrize("follower", ["AdapterFollower", "SelfApplying"])
def test_followers_hold_base_plus_b_a_of_every_version_a_trainer_publishes_as_adapters(tmp_path, follower):
    graph = tmp_path / "graph.yaml"
    graph.write_text(f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  follower: {{kind: "{A}:{follower}"}}
  trainer: {{kind: "{A}:AdapterTrainer"}}
edges:
  - numbers -> follower
  - follower -> trainer
weights:
  - trainer -> follower
schedule: {{steps: 6, batch_size: 2, max_staleness: 0}}
""")
    env = {"FLOWRL_WEIGHT_DIGEST": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = run_graph(graph, tmp_path / "run", env=env, cwd=ROOT, timeout_s=200)
    assert result.exit_code == 0, result.stderr[-3000:]
    assert not [r for r in result.ledger if r["event"] == "node_down"]  # fault-free: no restarts
    rows = [r for r in result.ledger if r["event"] == "weights"]
    published = {r["version"]: r["digest"] for r in rows if r["node"].startswith("trainer/")}
    held = [(r["version"], r["digest"]) for r in rows if r["node"].startswith("follower/")]
    assert set(range(1, 7)) <= set(published) and held, (published, held)
    assert all(digest == published[v] for v, digest in held)  # the adapters held are the ones published
    consumed = [r for r in result.ledger if r["event"] == "consumed"]
    assert [r["policy_version"] for r in consumed] == list(range(6))  # every version landed (checked per batch)
