"""Weight sync inside a real PPO run: the rollout holds bitwise the actor's weights of each version."""

from pathlib import Path

import pytest

from flowrl.testing import run_graph

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]


def test_rollout_weights_are_bitwise_the_actors_at_every_version(tmp_path):
    """Every version the rollout took is one the actor published, bit for bit.

    One `weights` row per completed sync round and member (flowrl/runtime/controller/weightorders.py): the
    actor writes one per version it publishes and one per round it serves; the rollout one per
    round it receives. How many rounds a run has is timing: the controller orders one when the
    sync group forms and one per published version, but a round sends the publisher's newest
    snapshot, not the version its order named (flowrl/weights/publisher.py). With max_staleness=1
    the actor often has version k+1 before it serves the order for k, so that round delivers k+1
    and the next order delivers k+1 again: the same version recorded twice at the rollout (and at
    the actor), each row a real round. So the test counts versions, not rows."""
    steps = 6
    result = run_graph(ROOT / "graphs" / "ppo.yaml", tmp_path / "run",
                       overrides=[f"schedule.steps={steps}", "schedule.batch_size=8", "schedule.max_staleness=1"],
                       env={"FLOWRL_WEIGHT_DIGEST": "1"}, timeout_s=150)
    assert result.exit_code == 0, result.stderr[-3000:]
    rows = [r for r in result.ledger if r["event"] == "weights"]
    actor = {r["version"]: r["digest"] for r in rows if r["node"].startswith("actor/")}
    rollout = [(r["version"], r["digest"]) for r in rows if r["node"].startswith("rollout/")]
    assert set(range(1, steps + 1)) <= set(actor), sorted(actor)  # one published version per update
    assert len(set(actor.values())) == len(actor)  # every update changed the weights
    for version, digest in rollout:
        assert version in actor, f"the rollout holds version {version}, which the actor never had"
        assert digest == actor[version], f"rollout differs from the actor at version {version}"
    versions = [v for v, _ in rollout]
    assert versions == sorted(versions), versions  # never back to an older version (no rollback here)
    # the version gate: a ticket is generated with at least its min_version, which only a sync brings
    needed = max(r["min_version"] for r in result.ledger if r["event"] == "issued")
    assert needed == (steps - 1) - 1 and max(versions, default=0) >= needed, (needed, versions)  # last ticket - k
