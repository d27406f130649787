"""The controller's metrics work waits until its control socket is quiet (RunReport.backlog), in
order: a row holds what came before its step and nothing after, whenever it is written."""

from __future__ import annotations

import json
from types import SimpleNamespace

import msgpack

from flowrl.metrics import MetricsHub, Recorder
from flowrl.runtime.controller.report import RunReport

TRAINER = SimpleNamespace(id="trainer/0/0")  # a Proc; the report names it in a warning at most


def _wire(rec: Recorder) -> dict:
    return msgpack.unpackb(msgpack.packb(rec.drain()))  # as a node's snapshot comes, over the wire


def _rows(tmp_path) -> list[dict]:
    text = (tmp_path / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def test_snapshots_and_rows_wait_for_catch_up_and_keep_their_order(tmp_path, clock):
    hub = MetricsHub(tmp_path, clock=clock)
    report = RunReport(hub, tmp_path)
    rec = Recorder("trainer", 0, clock=clock)
    rec.count("samples", 8)
    report.ingest(TRAINER, _wire(rec))
    clock.t += 1.0
    report.ticket(1, 1, 1, 0, done=False)  # step 1 ends here
    rec.count("samples", 5)
    report.ingest(TRAINER, _wire(rec))  # after step 1: step 2's
    assert len(report.backlog) == 3 and not hub.reporters  # nothing parsed, no row yet
    clock.t += 0.5  # written later, the row still ends where its step did
    report.catch_up()
    [row] = _rows(tmp_path)
    assert (row["step"], row["samples"], row["step_time_s"]) == (1, 8, 1.0)
    clock.t += 0.5
    report.ticket(2, 1, 2, 0, done=True)  # the last step: its row waits for the nodes' last metrics
    report.write_last_row()  # at the run's end: what waited first, then that row
    hub.close()
    assert [(r["step"], r["samples"]) for r in _rows(tmp_path)] == [(1, 8), (2, 5)]
    assert not report.backlog
