"""graphs/agent-tools-vllm.yaml for real: agent episodes whose turns vLLM's CPU build serves through
the `agent -> rollout` service, formatted by a Hugging Face chat template. Every trajectory is the
engine's tokens and the template's, checked against the rollout's own record."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from flowrl.agents.exact import check_run  # noqa: E402
from flowrl.testing import run_graph  # noqa: E402
from flowrl.testing.chat_model import write_chat_model  # noqa: E402

pytestmark = pytest.mark.timeout(600)
GRAPH = Path(__file__).resolve().parents[2] / "graphs" / "agent-tools-vllm.yaml"


def test_vllm_serves_agent_turns_token_exact(tmp_path):
    model = write_chat_model(tmp_path / "chat-tiny", hidden=128)
    spec = '{type: hf, path: "%s"}' % Path(model).as_posix()
    overrides = [f"nodes.{n}.config.model={spec}" for n in ("agent", "rollout", "actor")]
    result = run_graph(GRAPH, tmp_path / "run", timeout_s=560, overrides=[
        *overrides, "schedule.steps=3", "nodes.rollout.config.record_requests=true",
        "nodes.agent.config.record_trajectories=true",
        "supervision.deadline_s=30"])  # a shared CPU may starve a node's heartbeat for 5 s; hangs are not the point
    assert result.exit_code == 0, result.stderr[-3000:]
    assert not [r for r in result.ledger if r["event"] == "node_down"]
    report = check_run(result.run_dir)
    assert report.ok, report.problems[:3]
    assert report.trajectories == 3 * 2 * 4 and report.turns >= report.trajectories
