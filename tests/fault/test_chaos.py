"""Chaos suite: kill, hang, corrupt and break the real PPO and GRPO graphs; every ticket still
counts exactly once, or the run fails fast naming the node."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from flowrl.testing import read_jsonl, run_graph
from flowrl.testing.harness import flowrl_command, kill_group

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
PPO = ROOT / "graphs" / "ppo.yaml"
GRPO = ROOT / "graphs" / "grpo.yaml"

# Small and quick: the point here is recovery, not learning.
# Every node of graphs/grpo.yaml but the actor runs inside the rollout's process (fuse_into); the tests
# that fault the reward give each its own process again.
OWN = [f"nodes.{n}.fuse_into=null" for n in ("prompts", "reward", "reference", "advantages")]
FAST = ["schedule.steps=8", "schedule.batch_size=4", "schedule.checkpoint_every=2", "schedule.ticket_timeout_s=30",
        "supervision.heartbeat_s=0.2", "supervision.deadline_s=4"]


def assert_completed_exactly_once(result, steps=8):
    assert result.exit_code == 0, result.stderr[-4000:]
    audit = result.audit()
    assert audit.exactly_once, f"lost {audit.lost}, duplicated {audit.duplicated}"
    assert len(audit.issued) == steps
    assert len(result.metrics) >= steps


@pytest.mark.parametrize("graph,node", [
    (PPO, "rollout"), (PPO, "reward"), (PPO, "reference"), (PPO, "critic"), (PPO, "actor"),
    (GRPO, "rollout"), (GRPO, "actor"),
])
def test_kill_9_of_any_node_mid_run_completes_with_every_ticket_once(tmp_path, graph, node):
    result = run_graph(graph, tmp_path / "run", overrides=FAST, faults=[f"kill:{node}@step=3"], timeout_s=200)
    assert_completed_exactly_once(result)
    down = [r for r in result.ledger if r["event"] == "node_down"]
    assert [r["node"].split("/")[0] for r in down] == [node]


def test_hung_node_is_detected_within_the_deadline_and_replaced(tmp_path):
    result = run_graph(GRPO, tmp_path / "run", overrides=FAST + OWN, faults=["hang:reward@step=2"], timeout_s=200)
    assert_completed_exactly_once(result)
    (down,) = [r for r in result.ledger if r["event"] == "node_down"]
    assert "hung" in down["why"]
    silent = float(down["why"].split("missed heartbeats for ")[1].split(" s")[0])
    # judged by the deadline this run set (when exactly: tests/runtime/test_supervisor.py), never before it
    assert "(deadline 4.0 s)" in down["why"] and silent >= 4, down["why"]  # printed to 0.1 s


def test_rollout_dying_in_the_middle_of_a_weight_broadcast_does_not_hang(tmp_path):
    result = run_graph(GRPO, tmp_path / "run", overrides=FAST, faults=["fail_sync:rollout@version=3", "kill:rollout@step=5"],
                       timeout_s=200)
    assert_completed_exactly_once(result)


def test_corrupted_frames_are_rejected_and_counted_and_the_run_completes(tmp_path):
    result = run_graph(GRPO, tmp_path / "run", overrides=FAST + OWN, faults=["corrupt:reward@step=2"], timeout_s=200)
    assert_completed_exactly_once(result)
    log = result.log("reference.0.0")
    assert "reject" in log.lower(), log[-2000:]
    rejected = [r.get("channel_rejected/reward->reference") for r in result.metrics]
    assert max(v or 0 for v in rejected) >= 1, "the rejection is counted in metrics.jsonl"


def test_node_crashing_every_time_exhausts_its_budget_and_fails_fast_naming_it(tmp_path):
    result = run_graph(GRPO, tmp_path / "run", overrides=FAST + OWN + ["nodes.reward.on_failure.max_restarts=2",
                                                             "nodes.reward.on_failure.backoff_s=0.1"],
                       faults=["crash:reward,every"], timeout_s=200)
    assert result.exit_code == 1
    assert "'reward'" in result.stderr and "restart budget of 2" in result.stderr
    assert "injected crash" in result.stderr
    # fast: at its third crash (two restarts spent), with no other node down and nothing waited out
    downs = [r["node"] for r in result.ledger if r["event"] == "node_down"]
    assert downs == ["reward/0/0"] * 3, downs
    assert [r["event"] for r in result.ledger if r["event"] == "failed"] == ["failed"]
    assert not [r for r in result.ledger if r["event"] == "reissued" and r.get("reason") == "timeout"]


def test_controller_killed_mid_run_resumes_without_losing_or_repeating_a_ticket(tmp_path):
    run_dir = tmp_path / "run"
    cmd = flowrl_command(GRPO, run_dir, overrides=FAST)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            latest = run_dir / "checkpoints" / "latest.json"
            if latest.exists() and json.loads(latest.read_text())["step"] >= 4:
                break
            time.sleep(0.1)  # polling progress on disk, not ordering events
        else:
            pytest.fail("no checkpoint at step 4 within 150 s")
        os.kill(proc.pid, signal.SIGKILL)  # the controller only; its node processes notice and exit
        proc.wait(timeout=10)
    finally:
        kill_group(proc.pid)
        proc.wait()
    result = run_graph(None, run_dir, extra=["--resume", str(run_dir)], timeout_s=200)
    assert_completed_exactly_once(result)
    rows = read_jsonl(run_dir / "ledger.jsonl")
    assert any(r["event"] == "resumed" for r in rows)
