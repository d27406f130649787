"""Weight sync inside a real PPO run: the rollout holds bitwise the actor's weights of each version."""

from pathlib import Path

import pytest

from flowrl.testing import run_graph

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]


def test_rollout_weights_are_bitwise_the_actors_at_every_version(tmp_path):
    result = run_graph(ROOT / "graphs" / "ppo.yaml", tmp_path / "run",
                       overrides=["schedule.steps=6", "schedule.batch_size=8", "schedule.max_staleness=1"],
                       env={"FLOWRL_WEIGHT_DIGEST": "1"}, timeout_s=150)
    assert result.exit_code == 0, result.stderr[-3000:]
    rows = [r for r in result.ledger if r["event"] == "weights"]
    actor = {r["version"]: r["digest"] for r in rows if r["node"].startswith("actor/")}
    rollout = [(r["version"], r["digest"]) for r in rows if r["node"].startswith("rollout/")]
    assert len(actor) >= 6 and len(rollout) >= 6
    for version, digest in rollout:
        if version in actor:
            assert digest == actor[version], f"rollout differs from the actor at version {version}"
    assert len({v for v, _ in rollout} & set(actor)) >= 3  # with k=1 a newer snapshot may overtake an order
    assert len(set(actor.values())) == len(actor)  # every update changed the weights
