"""Colocated nodes that take turns (`take_turns`): a real GRPO run whose actor and rollout share one
CPU core. Their calls never overlap, the side that waits sleeps and its RSS drops (measured and
printed), and a kill -9 of either while it holds its turn recovers exactly once without
deadlocking its partner."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from flowrl.testing import run_graph

GRAPH = """
name: grpo-turns
seed: 0
vars:
  model: &model {type: tiny, d_model: 512, n_layers: 2, n_heads: 4}
  task: &task {name: reverse, digits: 4}
nodes:
  prompts: {kind: prompts, config: {task: *task}}
  rollout:
    kind: rollout
    devices: [0]
    colocate_with: [actor]
    take_turns: true
    config: {model: *model, samples_per_prompt: 4}
  reward: {kind: reward, config: {task: *task}}
  advantages: {kind: group_advantages}
  actor:
    kind: actor
    devices: [0]
    config: {model: *model, train: {lr: 1.0e-3, mini_batches: 1}}
edges: [prompts -> rollout, rollout -> reward, reward -> advantages, advantages -> actor]
weights: [actor -> rollout]
schedule: {steps: STEPS, batch_size: 4, max_staleness: STALENESS, checkpoint_every: 2}
"""


def graph(tmp_path: Path, steps: int = 4, staleness: int = 0) -> Path:
    path = tmp_path / "turns.yaml"
    path.write_text(GRAPH.replace("STEPS", str(steps)).replace("STALENESS", str(staleness)))
    return path


def events(run_dir: Path) -> list[dict]:
    trace = json.loads((run_dir / "trace.json").read_text())
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def spans(run_dir: Path, node: str, names=("compute",)) -> list[tuple[float, float]]:
    """(start, end) in µs of `node`'s spans named `names`, from the run's Chrome trace."""
    events_ = events(run_dir)
    pids = {e["pid"] for e in events_ if e.get("ph") == "M" and e.get("name") == "process_name"
            and str(e["args"]["name"]).split("/")[0] == node}
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events_
                  if e.get("ph") == "X" and e.get("pid") in pids and e.get("name") in names)


def released_mb(run_dir: Path, node: str) -> list[float]:
    """What each sleep of `node` released, from its log lines (`slept (...): RSS a -> b MB, x MB released`)."""
    text = "".join(p.read_text() for p in (run_dir / "logs").glob(f"{node}.*"))
    return [float(x) for x in re.findall(r"slept \(turn \d+ of [^)]*\): RSS [\d.]+ -> [\d.]+ MB, (-?[\d.]+) MB released", text)]


def overlaps(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list:
    return [(x, y) for x in a for y in b if x[0] < y[1] and y[0] < x[1]]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("staleness", [0, 1])
def test_colocated_actor_and_rollout_take_turns_and_the_sleeping_side_releases_memory(tmp_path, staleness):
    result = run_graph(graph(tmp_path, steps=4, staleness=staleness), tmp_path / "run", timeout_s=150)
    assert result.exit_code == 0, result.stderr[-3000:]
    assert not any(r["event"] == "node_down" for r in result.ledger), "a fault-free run restarted a node"
    audit = result.audit(["actor"])
    assert audit.exactly_once, (audit.lost[:5], audit.duplicated[:5])
    rows = result.metrics
    assert rows[-1]["step"] == 4 and all("reward_mean" in r for r in rows)
    # the turns: the actor's and the rollout's calls never run at the same time
    actor, rollout = spans(result.run_dir, "actor"), spans(result.run_dir, "rollout")
    assert len(actor) >= 4 and len(rollout) >= 4, (actor, rollout)
    assert overlaps(actor, rollout) == []
    # the side that waits slept: its memory went (parameters + optimizer state of a d_model 512 model)
    a_mb, r_mb = released_mb(result.run_dir, "actor"), released_mb(result.run_dir, "rollout")
    print(f"\nmax_staleness {staleness}: RSS released per sleep, actor {[round(x) for x in a_mb]} MB, "
          f"rollout {[round(x) for x in r_mb]} MB")
    # turn 0 (after setup) and at least one turn between two of the other's; with max_staleness 1 the
    # actor may train two tickets in one turn, and the last holder never sleeps
    assert len(a_mb) >= 2 and len(r_mb) >= 2
    assert max(a_mb) > 60, a_mb  # ~26 MB of weights x (params, grads, 2 Adam moments)
    assert max(r_mb) > 15, r_mb  # the engine's weights
    assert any(k.endswith("sleep_rss_released_mb_max") for r in rows for k in r), sorted(rows[-1])
    # weights went by the handoff (actor and rollout share one device), not a broadcast
    syncs = [e for e in events(result.run_dir) if e.get("name") == "weight_sync" and e.get("ph") == "X"]
    assert syncs and all(e["args"].get("handoff") for e in syncs), syncs[:3]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("node", ["actor", "rollout"])
def test_a_kill_during_its_turn_recovers_exactly_once_without_deadlocking_its_partner(tmp_path, node):
    # the fault fires inside the call, i.e. while the node holds the group's turn
    result = run_graph(graph(tmp_path, steps=6), tmp_path / "run", faults=[f"kill:{node}@step=2"], timeout_s=200)
    assert result.exit_code == 0, result.stderr[-3000:]
    downs = [r for r in result.ledger if r["event"] == "node_down"]
    assert len(downs) == 1 and node in json.dumps(downs[0]), downs
    audit = result.audit(["actor"])
    assert audit.exactly_once, (audit.lost[:5], audit.duplicated[:5])
    assert result.metrics[-1]["step"] == 6
    assert overlaps(spans(result.run_dir, "actor"), spans(result.run_dir, "rollout")) == []


@pytest.mark.timeout(180)
def test_colocated_without_turns_still_hands_weights_off_and_a_spread_graph_broadcasts(tmp_path):
    """`colocate_with` on the same devices, no take_turns: the weights go by handoff, while both
    nodes run as they please; the same graph without colocation broadcasts."""
    text = GRAPH.replace("STEPS", "3").replace("STALENESS", "1").replace("    take_turns: true\n", "")
    (tmp_path / "colocated.yaml").write_text(text)
    spread = text.replace("    colocate_with: [actor]\n", "")
    (tmp_path / "spread.yaml").write_text(spread)
    for name, handoff in (("colocated", True), ("spread", False)):
        result = run_graph(tmp_path / f"{name}.yaml", tmp_path / name, timeout_s=150)
        assert result.exit_code == 0, result.stderr[-3000:]
        assert not any(r["event"] == "node_down" for r in result.ledger)
        assert result.metrics[-1]["step"] == 3
        syncs = [e for e in events(result.run_dir) if e.get("name") == "weight_sync" and e.get("ph") == "X"]
        assert syncs and all(bool(e["args"].get("handoff")) is handoff for e in syncs), (name, syncs[:3])
