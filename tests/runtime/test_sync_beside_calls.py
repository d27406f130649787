"""A trainer serves a weight sync while a call of its own runs (flowrl/runtime/worker/syncs.py,
`serve_lane`): a sync order that waited for the running call would leave the rollout idle for a
whole training step with `max_staleness >= 1`. Here the trainer's call for each batch returns only
once the subscriber holds the trainer's current version, so the run ends only if syncs are served
beside calls (before, it failed after `wait_s`).

A plain subscriber, too, receives a round while its call runs (`FetchLane`) and lands it between
two calls: its trace shows the rounds inside its calls, and `Follower` checks at the end of every
call that the weights it holds are exactly the version it was told (a round written into the live
weights during a call would fail it)."""

import json

import pytest

from flowrl.testing import run_graph

pytestmark = pytest.mark.timeout(150)
N = "flowrl.testing.nodes"


def run_fault_free(tmp_path, follower: str, trainer: str):
    """numbers -> follower -> trainer, weights trainer -> follower, 8 steps with max_staleness 1."""
    graph = tmp_path / "g.yaml"
    graph.write_text(f"""
name: beside
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  follower: {follower}
  trainer: {trainer}
edges: [numbers -> follower, follower -> trainer]
weights: [trainer -> follower]
schedule: {{steps: 8, batch_size: 2, max_staleness: 1}}
""")
    result = run_graph(graph, tmp_path / "run", timeout_s=120)
    assert result.exit_code == 0, result.stderr[-3000:]
    assert not [r for r in result.ledger if r["event"] == "restarted"], "a fault-free run restarted a node"
    return result


def test_a_trainer_serves_syncs_while_it_trains(tmp_path):
    held = tmp_path / "held"
    result = run_fault_free(tmp_path, f'{{kind: "{N}:HeldVersion", config: {{held_file: "{held}"}}}}',
                            f'{{kind: "{N}:TrainsWhileServing", config: {{held_file: "{held}", wait_s: 30}}}}')
    consumed = [r for r in result.ledger if r["event"] == "consumed"]
    assert len(consumed) == 8
    assert int(held.read_text()) >= 7  # the subscriber took every version up to the last but one


def test_a_subscriber_receives_rounds_while_its_calls_run_and_lands_them_between_calls(tmp_path):
    result = run_fault_free(tmp_path, f'{{kind: "{N}:Follower", config: {{delay_s: 0.25}}}}', f'{{kind: "{N}:Trainer"}}')
    assert result.audit().exactly_once
    events = json.loads((tmp_path / "run" / "trace.json").read_text())
    pid = next(e["pid"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"
               and e["args"]["name"].startswith("follower"))
    spans = [e for e in events if e.get("ph") == "X" and e["pid"] == pid]
    calls = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e["name"] == "compute"]
    syncs = [e for e in spans if e["name"] == "weight_sync"]
    # the first round makes the subscriber, in its order's turn, and orders that came meanwhile wait
    # for it; from the first round received ahead on, every round is
    ahead = [bool((e.get("args") or {}).get("beside")) for e in sorted(syncs, key=lambda e: e["ts"])]
    assert not ahead[0] and ahead[ahead.index(True):] == [True] * (len(ahead) - ahead.index(True)), ahead
    rounds = [(e["ts"], e["ts"] + e["dur"]) for e in syncs if (e.get("args") or {}).get("beside")]
    assert len(rounds) >= 4, ahead
    inside = [r for r in rounds if any(a <= r[0] and r[1] <= b for a, b in calls)]
    # the trainer takes a batch and publishes within a few ms; the follower's next call runs 250 ms
    assert len(inside) >= len(rounds) // 2, (rounds, calls)
