"""The last step's row holds what every process recorded for that step, including what a
follower rank reports after its leader's consumption ended the run (it used to be cut off)."""

from __future__ import annotations

import pytest

from flowrl.testing import run_graph

pytestmark = pytest.mark.timeout(150)

GRAPH = """\
nodes:
  numbers: {kind: "flowrl.testing.nodes:Numbers"}
  collect: {kind: "flowrl.testing.nodes:Collect", devices: 2, config: {delay_s: 0.15}}
edges: [numbers -> collect]
schedule: {steps: 6, batch_size: 3}
"""


def test_the_last_row_counts_what_every_rank_recorded_for_the_last_step(tmp_path):
    path = tmp_path / "graph.yaml"
    path.write_text(GRAPH)
    result = run_graph(path, tmp_path / "run", timeout_s=140)
    assert result.exit_code == 0, result.stderr[-3000:]
    rows = result.metrics
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    # 6 tickets x 3 samples, split over two ranks (2 + 1): each rank's count reaches a row
    assert sum(r.get("samples") or 0 for r in rows) == 18, [r.get("samples") for r in rows]
