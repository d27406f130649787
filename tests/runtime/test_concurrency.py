"""Several calls of one node at once (`concurrency`), groups as tickets (`schedule.ticket: group`)
and weights that land while calls are in flight, as real runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.testing import node_state, run_graph

pytestmark = pytest.mark.timeout(240)

N = "flowrl.testing.nodes"


def graph(tmp_path: Path, *, concurrency: int, steps: int = 4, per: int = 4, k: int = 1, every: int = 2) -> Path:
    path = tmp_path / "graph.yaml"
    path.write_text(f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  overlap: {{kind: "{N}:Overlap", concurrency: {concurrency}, config: {{per_update: {per}, size: 64}}}}
  log: {{kind: "{N}:UpdateLog", config: {{size: 64}}}}
edges: [numbers -> overlap, overlap -> log]
weights: [log -> overlap]
schedule: {{steps: {steps}, batch_size: {per}, ticket: group, max_staleness: {k}, checkpoint_every: {every}}}
supervision: {{heartbeat_s: 0.2, deadline_s: 10.0}}  # no fault here: a loaded machine's late beat is no hang
""")
    return path


def test_calls_overlap_groups_make_updates_in_order_and_weights_land_mid_call(tmp_path):
    result = run_graph(graph(tmp_path, concurrency=8), tmp_path / "run", timeout_s=200)
    assert result.exit_code == 0, result.stderr[-3000:]
    assert not [r for r in result.ledger if r["event"] in ("node_down", "recovery")]  # zero restarts
    audit = result.audit(["log"])
    assert audit.exactly_once, (audit.lost[:5], audit.duplicated[:5])
    assert len(audit.issued) == 16  # 4 updates of 4 groups, one ticket each
    updates = node_state(result.run_dir, "log")["seen"]
    assert [u[2] for u in updates] == [[4 * n + g for g in range(4)] for n in range(4)]  # whole updates, in order
    seen = [s for u in updates for s in u[3]]
    assert max(s[2] for s in seen) >= 2, "no two calls of `overlap` were ever in flight together"
    assert any(end > start for start, end, _ in seen), "no version landed while a call was in flight"
    for n, (_, _, _, rows, oldest, trained_at) in enumerate(updates):
        assert trained_at == n and oldest == min(r[0] for r in rows)
        assert trained_at - oldest <= 1  # the staleness bound, on each group's oldest version
    rows = [r for r in result.metrics if "staleness_max" in r]
    assert len(rows) == 4 and all(r["staleness_max"] <= 1 for r in rows)  # one metrics row per update


def test_without_concurrency_calls_never_overlap(tmp_path):
    result = run_graph(graph(tmp_path, concurrency=1, steps=2, k=0), tmp_path / "run", timeout_s=200)
    assert result.exit_code == 0, result.stderr[-3000:]
    seen = [s for u in node_state(result.run_dir, "log")["seen"] for s in u[3]]
    assert max(s[2] for s in seen) == 1 and all(end == start for start, end, _ in seen)
