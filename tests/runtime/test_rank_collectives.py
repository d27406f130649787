"""Data-parallel nodes whose calls are collectives, as real trainers' are: `GroupSum` all-reduces
inside `process` (a DDP backward), `GroupTrainer` all-reduces and publishes weights gathered from
every rank (an FSDP2 trainer's full_tensor). Every rank must make the same collectives in the same
order, and the event loop must keep serving channels while a rank waits in one: a leader that
blocked its loop in a collective while its follower's shard was still queued deadlocked
data-parallel PPO."""

from __future__ import annotations

import pytest

from flowrl.testing import node_state, run_graph

N = "flowrl.testing.nodes"
STEPS = 12

GRAPH = f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  follow: {{kind: "{N}:Follower"}}
  gsum: {{kind: "{N}:GroupSum", devices: 2}}
  norm: {{kind: "{N}:Normalizer"}}
  train: {{kind: "{N}:GroupTrainer", devices: 2}}
edges: [numbers -> follow, follow -> gsum, gsum -> norm, norm -> train]
weights: [train -> follow]
schedule: {{steps: {STEPS}, batch_size: 4, max_staleness: 1, checkpoint_every: 4}}
supervision: {{heartbeat_s: 0.2}}
"""


def _run(tmp_path, faults=()):
    (tmp_path / "g.yaml").write_text(GRAPH)
    result = run_graph(tmp_path / "g.yaml", tmp_path / "run", faults=list(faults), timeout_s=240)
    assert result.exit_code == 0, result.stderr[-3000:]
    assert result.audit(["train"]).exactly_once
    return result


def _restarts(result) -> list[dict]:
    return [r for r in result.ledger if r["event"] in ("node_down", "reissued", "recovery", "failed")]


def _check_totals(result) -> None:
    """Each rank's `total` is the sum over both ranks' shards of the same batch (the all-reduce saw
    both), and the trainer's all-reduced sample count is every sample of every ticket."""
    seen = [node_state(result.run_dir, "train", rank=r)["seen"] for r in (0, 1)]
    assert [b for b, *_ in seen[0]] == [b for b, *_ in seen[1]] and len(seen[0]) == STEPS
    for (bid, s0, t0), (_, s1, t1) in zip(*seen):
        assert t0 == t1 == s0 + s1, bid
    for r in (0, 1):
        assert node_state(result.run_dir, "train", rank=r)["samples"] == STEPS * 4


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("collectives"))


@pytest.mark.timeout(300)
def test_collectives_in_process_and_in_publishing_complete_with_no_restart(reference):
    assert _restarts(reference) == []
    _check_totals(reference)
    # `follow` checks every batch against the weights it holds (each version a gather from both ranks)
    versions = [r.get("policy_version", 0) for r in reference.ledger if r["event"] == "consumed"]
    assert max(versions) >= STEPS - 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("rank", [0, 1])
def test_a_delay_in_either_ranks_path_changes_nothing(tmp_path, reference, rank):
    """Each rank's calls, shards and answers held back in turn: the group still meets in every
    collective, with no restart, and ends in the states of the run without delays."""
    result = _run(tmp_path, [f"slow:gsum/0/{rank},seconds=0.15", f"delay:gsum/0/{rank},seconds=0.05",
                             f"slow:train/0/{rank},seconds=0.15", f"delay:train/0/{rank},seconds=0.05"])
    assert _restarts(result) == []
    _check_totals(result)
    for r in (0, 1):
        assert node_state(result.run_dir, "train", rank=r)["seen"] == node_state(reference.run_dir, "train", rank=r)["seen"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["kill:train/0/1@step=5", "kill:train/0/0@step=6", "kill:norm@step=6"])
def test_a_dead_rank_of_a_publishing_group_rolls_back_in_step(tmp_path, reference, fault):
    """A dead rank restarts its group; a dead `norm` (another stateful node) leaves the trainer's ranks
    running, and they roll back at the leader's word: both load their checkpoint and publish it (a
    snapshot gathered from both ranks) together. Either way the run ends in the fault-free states,
    exactly once."""
    result = _run(tmp_path, [fault])
    downs = [(r["node"], r["why"]) for r in result.ledger if r["event"] == "node_down"]
    if "norm" in fault:
        assert downs == [("norm/0/0", "exited")], downs
    else:  # the killed rank is the one named; its partner went down with its group (one record)
        killed = fault.split(":")[1].split("@")[0]
        mate = killed[:-1] + ("0" if killed.endswith("1") else "1")
        assert downs == [(killed, "exited"), (mate, f"its rank group lost {killed}")], downs
    assert any(r["event"] == "recovery" for r in result.ledger)
    _check_totals(result)
    for r in (0, 1):
        assert node_state(result.run_dir, "train", rank=r)["seen"] == node_state(reference.run_dir, "train", rank=r)["seen"]
