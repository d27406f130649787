"""Agentic GRPO for real (graphs/agent-tools.yaml): agent processes run episodes whose model turns
are served by rollout replicas through the `agent -> rollout` service. The reward rises, every
trajectory's tokens are what the engine generated (checked against the rollout's own record), and
kill -9 of an agent mid-episode or of one of two rollout replicas mid-request loses and repeats no
ticket; an environment that raises or hangs ends its episode, never the run."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from flowrl.agents.exact import check_run
from flowrl.testing import run_graph

pytestmark = pytest.mark.timeout(400)

ROOT = Path(__file__).resolve().parents[2]
GRAPH = ROOT / "graphs" / "agent-tools.yaml"
RECORD = ["nodes.rollout.config.record_requests=true", "nodes.agent.config.record_trajectories=true"]


def trajectories(run_dir: Path) -> list[dict]:
    return [json.loads(line) for f in sorted((run_dir / "trajectories").glob("*.jsonl"))
            for line in f.read_text().splitlines()]


def test_the_calc_agent_learns_and_every_trajectory_is_what_the_engine_generated(tmp_path):
    steps = 70
    result = run_graph(GRAPH, tmp_path / "run", overrides=[f"schedule.steps={steps}", *RECORD], timeout_s=380)
    assert result.exit_code == 0, result.stderr[-3000:]
    assert not [r for r in result.ledger if r["event"] == "node_down"]  # fault-free: nothing restarted
    assert result.audit().exactly_once
    rewards = [r["reward_mean"] for r in sorted(result.metrics, key=lambda r: r["step"])]
    assert len(rewards) == steps
    first, last = statistics.mean(rewards[:15]), statistics.mean(rewards[-15:])
    assert last > first + 0.15, (first, last)  # graphs/agent-tools.yaml: ~0.1 over steps 1-15, ~0.35 over 56-70
    report = check_run(result.run_dir)
    assert report.ok, report.problems[:3]
    assert report.trajectories == steps * 8 * 8 and report.turns > report.trajectories  # multi-turn episodes
    assert any(t["finish"] == "done" for t in trajectories(result.run_dir))


@pytest.mark.parametrize("fault", ["kill:agent@request=40", "kill:rollout/0@request=30"])
def test_a_kill_mid_episode_or_mid_request_loses_and_repeats_no_ticket(tmp_path, fault):
    result = run_graph(GRAPH, tmp_path / "run", faults=[fault], timeout_s=300,
                       overrides=["schedule.steps=6", "nodes.rollout.replicas=2", *RECORD])
    assert result.exit_code == 0, result.stderr[-3000:]
    downs = [r["node"].split("/")[0] for r in result.ledger if r["event"] == "node_down"]
    assert downs == [fault.split(":")[1].split("/")[0].split("@")[0]]
    audit = result.audit()
    assert audit.exactly_once, (audit.lost, audit.duplicated)
    report = check_run(result.run_dir)  # the re-issued tickets' episodes too
    assert report.ok, report.problems[:3]


def test_an_environment_that_raises_or_hangs_ends_its_episode_not_the_run(tmp_path):
    result = run_graph(GRAPH, tmp_path / "run", timeout_s=300, overrides=[
        "schedule.steps=2", "nodes.agent.config.env=flowrl.testing.agent_envs:Flaky",
        # the deadline well above a plain episode's time on a busy machine (about 1 s under the
        # suite's two workers, 5 s on a machine whose fresh memory pages are slow), the hang far
        # above the deadline: only the hanging episodes hit it
        "nodes.agent.config.env_config={every: 4, hang_s: 90.0}", "nodes.agent.config.episode_timeout_s=20.0",
        "nodes.agent.config.error_reward=-1.0", *RECORD])
    assert result.exit_code == 0, result.stderr[-3000:]
    assert not [r for r in result.ledger if r["event"] == "node_down"]
    assert result.audit().exactly_once
    finishes = [t["finish"] for t in trajectories(result.run_dir)]
    assert finishes.count("env_error") == finishes.count("deadline") == len(finishes) // 4
    assert all(t["reward"] == -1.0 for t in trajectories(result.run_dir) if t["finish"] != "done"
               and t["finish"] != "max_turns")
