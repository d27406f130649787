"""PPO with a data-parallel actor and critic (devices: 2 each): every rank trains on half of every
batch, the policy learns as the 1-rank one does, and a killed rank costs nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.testing import node_state, run_graph

ROOT = Path(__file__).resolve().parents[2]
DP = ["nodes.actor.devices=2", "nodes.critic.devices=2"]


@pytest.mark.timeout(300)
def test_ppo_with_two_rank_actor_and_critic_learns_with_half_of_every_batch_per_rank(tmp_path):
    # the default supervision settings: a hang fails the test (its timeout), it is never routed
    # around by a short process timeout that restarts the stuck rank group
    result = run_graph("graphs/ppo.yaml", tmp_path / "run", cwd=ROOT, overrides=[*DP, "schedule.steps=90"],
                       timeout_s=280)
    assert result.exit_code == 0, result.stderr[-3000:]
    assert result.audit(["actor"]).exactly_once
    restarts = [r for r in result.ledger if r["event"] in ("node_down", "reissued", "recovery")]
    assert restarts == [], restarts[:5]  # a fault-free run: nothing restarted, nothing re-issued
    rows = [r for r in result.metrics if "reward_mean" in r]
    assert max(r["reward_mean"] for r in rows[-15:]) >= 0.9, [round(r["reward_mean"], 2) for r in rows[::10]]
    # 32 prompts x 4 samples per step: each rank of the actor trains on 64 of the 128 samples
    halves = [(r.get("actor/rank_samples/0", 0), r.get("actor/rank_samples/1", 0)) for r in result.metrics]
    # (under load a rank's count can land in the next step's row: compare the run's totals; the last
    # row waits for what the ranks report on their way out)
    assert all(a % 64 == 0 and b % 64 == 0 for a, b in halves)
    assert sum(a for a, _ in halves) == sum(b for _, b in halves) == 64 * 90


@pytest.mark.timeout(300)
def test_killing_one_rank_of_the_actor_restarts_its_group_and_loses_no_ticket(tmp_path):
    result = run_graph("graphs/ppo.yaml", tmp_path / "run", cwd=ROOT,
                       overrides=[*DP, "schedule.steps=16", "schedule.checkpoint_every=5", "schedule.batch_size=8"],
                       faults=["kill:actor/0/1@step=8"], timeout_s=280)
    assert result.exit_code == 0, result.stderr[-3000:]
    assert result.audit(["actor"]).exactly_once
    # the killed rank is named, its partner (whose gloo read failed, so it exited too) went down with
    # its group: one record and one restart each
    downs = [(r["node"], r["why"]) for r in result.ledger if r["event"] == "node_down"]
    assert downs == [("actor/0/1", "exited"), ("actor/0/0", "its rank group lost actor/0/1")], downs
    recoveries = [r["reason"] for r in result.ledger if r["event"] == "recovery"]
    assert recoveries == ["actor/0/1 exited"], recoveries  # one recovery epoch (there were two)
    for rank in (0, 1):
        assert node_state(result.run_dir, "actor", rank=rank)["updates"] == 16
        assert node_state(result.run_dir, "critic", rank=rank)["updates"] == 16
