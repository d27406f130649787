"""DAPO's dynamic sampling as a real run: the filter holds the groups worth training on until a
batch is full, the scheduler replaces every ticket it held, and a crash of the filter or the
trainer neither loses nor repeats a group."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from flowrl.testing import node_state, run_graph
from flowrl.testing.harness import kill_controller_after_checkpoint

pytestmark = pytest.mark.timeout(180)

N = "flowrl.testing.nodes"


def graph(tmp_path: Path, k: int, steps: int = 8, delay_s: float = 0.0) -> Path:
    path = tmp_path / "graph.yaml"
    path.write_text(f"""\
nodes:
  groups: {{kind: "{N}:Groups", config: {{samples: 2, flat_every: 3}}}}
  dapo: {{kind: dapo_filter}}
  train: {{kind: "{N}:Rows", config: {{delay_s: {delay_s}}}}}
edges: [groups -> dapo, dapo -> train]
schedule: {{steps: {steps}, batch_size: 3, max_staleness: {k}, checkpoint_every: 5}}  # held groups at 5, 10, ...; the end is not a multiple
supervision: {{heartbeat_s: 0.2, deadline_s: 2.0}}
""")
    return path


@pytest.mark.parametrize("k,fault", [(0, None), (1, "kill:dapo@step=6"), (0, "kill:train@step=4")])
def test_every_training_batch_is_full_and_every_group_worth_training_on_is_used_exactly_once(tmp_path, k, fault):
    result = run_graph(graph(tmp_path, k), tmp_path / "run", faults=[fault] if fault else [], timeout_s=150)
    assert result.exit_code == 0, result.stderr[-3000:]
    # 3 prompts per ticket, one of them flat: 2 kept per ticket, so 8 updates of 3 groups take 12 tickets
    audit = result.audit(["train"])
    assert audit.exactly_once, (audit.lost[:5], audit.duplicated[:5])
    assert len(audit.issued) == 12
    replaced = Counter(r["batch_id"] for r in result.ledger if r["event"] == "replaced")
    replaced.subtract(r["batch_id"] for r in result.ledger if r["event"] == "replace_undone")  # by a rollback
    assert sorted(replaced.elements()) == ["t-000000", "t-000003", "t-000006", "t-000009"]
    seen = node_state(result.run_dir, "train")["seen"]
    assert len(seen) == 8 and all(len(rows) == 6 for _, rows in seen)  # the batch size is kept
    trained = [r for _, rows in seen for r in rows[::2]]
    assert trained == [r for r in range(36) if r % 3]  # each group once, in order, none flat
    if fault:
        assert any(r["event"] == "recovery" for r in result.ledger)  # the fault happened: state came back


def test_a_run_killed_while_groups_are_held_resumes_without_losing_or_repeating_one(tmp_path):
    path, run_dir = graph(tmp_path, 0, steps=16, delay_s=0.1), tmp_path / "run"
    assert kill_controller_after_checkpoint(path, run_dir, 10, timeout_s=90) < 24, "killed too late"
    result = run_graph(None, run_dir, extra=["--resume", str(run_dir)], timeout_s=120)
    assert result.exit_code == 0, result.stderr[-3000:]
    seen = node_state(result.run_dir, "train")["seen"]
    assert len(seen) == 16 and all(len(rows) == 6 for _, rows in seen)
    assert [r for _, rows in seen for r in rows[::2]] == [r for r in range(72) if r % 3]


def test_a_stateless_node_that_asks_for_replacements_fails_the_run_naming_it(tmp_path):
    path = tmp_path / "graph.yaml"
    path.write_text(f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  filter: {{kind: "{N}:DropEvery", config: {{every: 3, remainder: 1, replace: true}}}}
  collect: {{kind: "{N}:Collect"}}
edges: [numbers -> filter, filter -> collect]
schedule: {{steps: 6, batch_size: 2}}
supervision: {{heartbeat_s: 0.2, deadline_s: 2.0}}
""")
    result = run_graph(path, tmp_path / "run", timeout_s=90)
    assert result.exit_code != 0
    assert "'filter' returned Drop(replace=True) but is not stateful" in result.stderr
