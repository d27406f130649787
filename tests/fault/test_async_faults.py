"""Exactly once with calls in flight: a concurrent subscriber (`concurrency: 8`) whose weights land
mid-call, group tickets (`schedule.ticket: group`) and a trainer that takes the groups of one update
together -- under kill -9 of the concurrent node mid-call, of the trainer while it holds part of an
update, and of the controller (then `--resume`). Checked by the ledger and by what the trainer
trained on: every group exactly once, whole updates in ticket order, each group's oldest version
within the staleness bound."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.testing import node_state, run_graph
from flowrl.testing.harness import kill_controller_after_checkpoint

pytestmark = pytest.mark.timeout(300)

N = "flowrl.testing.nodes"
PER = 4  # groups per update


def graph(tmp_path: Path, steps: int, delay_s: float = 0.0) -> Path:
    path = tmp_path / "graph.yaml"
    path.write_text(f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  overlap: {{kind: "{N}:Overlap", concurrency: 8, config: {{per_update: {PER}, size: 64}}}}
  log: {{kind: "{N}:UpdateLog", config: {{size: 64, delay_s: {delay_s}}}}}
edges: [numbers -> overlap, overlap -> log]
weights: [log -> overlap]
schedule: {{steps: {steps}, batch_size: {PER}, ticket: group, max_staleness: 1, checkpoint_every: 2}}
supervision: {{heartbeat_s: 0.2, deadline_s: 3.0}}
""")
    return path


def check_trained(run_dir: Path, steps: int) -> None:
    updates = node_state(run_dir, "log")["seen"]
    assert [u[2] for u in updates] == [[PER * n + g for g in range(PER)] for n in range(steps)]
    for n, (_, _, _, rows, oldest, trained_at) in enumerate(updates):
        assert trained_at == n and trained_at - oldest <= 1, (n, oldest, trained_at)


@pytest.mark.parametrize("fault", ["kill:overlap@step=6", "kill:log@step=2"])
def test_a_kill_mid_flight_loses_and_repeats_no_group(tmp_path, fault):
    result = run_graph(graph(tmp_path, steps=6), tmp_path / "run", faults=[fault], timeout_s=240)
    assert result.exit_code == 0, result.stderr[-3000:]
    assert any(r["event"] == "node_down" for r in result.ledger)  # the fault happened
    audit = result.audit(["log"])
    assert audit.exactly_once, (audit.lost[:5], audit.duplicated[:5])
    check_trained(result.run_dir, 6)


def test_a_controller_killed_with_groups_in_flight_resumes_with_none_lost_or_repeated(tmp_path):
    path, run_dir = graph(tmp_path, steps=8, delay_s=0.2), tmp_path / "run"
    assert kill_controller_after_checkpoint(path, run_dir, 2 * PER) < 8 * PER, "killed too late"
    result = run_graph(None, run_dir, extra=["--resume", str(run_dir)], timeout_s=200)
    assert result.exit_code == 0, result.stderr[-3000:]
    audit = result.audit(["log"])
    assert audit.exactly_once, (audit.lost[:5], audit.duplicated[:5])
    check_trained(result.run_dir, 8)
