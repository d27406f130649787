"""The ledger's typed events and its one exactly-once rule (`net_consumption`), which the audit,
a resumed scheduler and the chaos checker all count with.

    python -m pytest -q tests/runtime/test_ledger.py
"""

import json

from flowrl.runtime.controller.scheduler import Scheduler
from flowrl.runtime.protocol import ledger as L
from flowrl.runtime.protocol.ledger import Ledger, audit_ledger, net_consumption, read_jsonl
from flowrl.testing.chaos.check import check_ledger

REPLACE = "[replace] dapo: 1/4 groups, waiting for more"  # a drop that asks for a replacement ticket


def row(event, bid, node=None, **extra):
    return {"event": event, "batch_id": bid, **({"node": node} if node is not None else {}), **extra}


def issued(*indices):
    return [row("issued", f"t-{i:06d}", index=i) for i in indices]


# the rule -----------------------------------------------------------------------------------------
def test_consumed_and_dropped_count_one_each_and_rolled_back_undoes_one_of_its_node():
    rows = [row("consumed", "t-000000", "actor"), row("dropped", "t-000000", "logger", by="f"),
            row("rolled_back", "t-000000", "actor"), row("consumed", "t-000000", "actor"),
            row("duplicate_dropped", "t-000000", "actor", why="older epoch")]
    c = net_consumption(rows)
    assert c.net[("t-000000", "actor")] == 1 and c.net[("t-000000", "logger")] == 1
    assert c.consumed[("t-000000", "actor")] == 2 and c.dropped[("t-000000", "logger")] == 1
    assert c.sinks == {"actor", "logger"}


def test_replicas_of_a_sink_count_as_that_sink():
    rows = [row("consumed", "t-000000", "collect/0/0"), row("consumed", "t-000000", "collect/1/0")]
    assert net_consumption(rows).net[("t-000000", "collect")] == 2


def test_a_rolled_back_without_node_undoes_the_tickets_latest_consumption():
    rows = [row("consumed", "t-000000", "a"), row("consumed", "t-000000", "b"), row("rolled_back", "t-000000")]
    net = net_consumption(rows).net
    assert net[("t-000000", "a")] == 1 and net[("t-000000", "b")] == 0


def test_the_audit_and_the_chaos_checker_agree_on_lost_and_duplicated():
    rows = issued(0, 1) + [row("consumed", "t-000000", "a/0/0"), row("consumed", "t-000000", "b"),
                           row("consumed", "t-000001", "a"), row("rolled_back", "t-000001", "a"),
                           row("consumed", "t-000001", "a"), row("consumed", "t-000001", "a")]
    audit = audit_ledger(rows, sinks=["a", "b"])
    check = check_ledger(rows, ["a", "b"])
    assert audit.duplicated == [("t-000001", "a")] and check.duplicated == ["t-000001@a x2"]
    assert audit.lost == [("t-000001", "b")] and check.lost == ["t-000001@b"]
    assert not audit.exactly_once


def test_a_replace_drop_rolled_back_and_dropped_again_is_exactly_once():
    rows = issued(0) + [row("dropped", "t-000000", "actor", by=REPLACE, replace=True),
                        row("replaced", "t-000000", steps=2), row("rolled_back", "t-000000", "actor"),
                        row("replace_undone", "t-000000", reason="recovery"),
                        row("dropped", "t-000000", "actor", by=REPLACE, replace=True)]
    audit = audit_ledger(rows, sinks=["actor"])
    assert audit.exactly_once and audit.dropped() == {"t-000000"}


# the scheduler writes and resumes by it ---------------------------------------------------------------
def make(path, steps=4, sinks=("actor", "logger"), stateful=("actor",), epoch=0):
    """A scheduler in recovery epoch `epoch` (the recovery book owns the epoch; the scheduler asks)."""
    return Scheduler(steps=steps, batch_size=1, max_staleness=3, sinks=list(sinks), stateful_sinks=list(stateful),
                     ticket_timeout_s=10, ledger=Ledger(path), epoch=lambda: epoch)


def test_a_resumed_scheduler_keeps_stateless_consumption_and_rolls_back_stateful(tmp_path):
    first = make(tmp_path / "ledger.jsonl", epoch=1)
    first.issuable()
    for i in range(3):
        first.consumed("logger", i)
    first.consumed("actor", 0)
    first.consumed("actor", 1)
    first.rollback(1, 1, "recovery")  # actor loses ticket 1: its net count is 0 again
    first.issuable()
    first.consumed("actor", 1)  # ... and has it once more
    first.ledger.flush()
    rows = read_jsonl(first.ledger.path)

    again = make(tmp_path / "ledger.jsonl", epoch=2)
    again.resume(1, 1, rows)
    again.ledger.flush()
    new = read_jsonl(again.ledger.path)[len(rows):]
    assert [(r["event"], r["batch_id"], r["node"]) for r in new] == [("rolled_back", "t-000001", "actor")]
    assert again.consumed_above("logger", 1) == [1, 2] and again.consumed_above("actor", 1) == []
    assert audit_ledger(read_jsonl(again.ledger.path), sinks=["logger"]).consumed["t-000002"] == 1
    net = net_consumption(read_jsonl(again.ledger.path)).net
    assert net[("t-000001", "actor")] == 0 and net[("t-000000", "actor")] == 1


def test_a_resumed_scheduler_undoes_replacements_past_the_checkpoint(tmp_path):
    first = make(tmp_path / "ledger.jsonl", sinks=("actor",))
    first.issuable()
    first.consumed("actor", 0)
    first.consumed("actor", 1, dropped_by=REPLACE)
    assert first.steps == 5
    first.ledger.flush()
    rows = read_jsonl(first.ledger.path)

    again = make(tmp_path / "ledger.jsonl", sinks=("actor",), epoch=1)
    again.resume(1, 1, rows)
    assert again.steps == 4  # ticket 1 is decided again: it replaces only if it drops again
    again.ledger.flush()
    new = [(r["event"], r.get("node")) for r in read_jsonl(again.ledger.path)[len(rows):]]
    assert new == [("replace_undone", None), ("rolled_back", "actor")]


# typed events ---------------------------------------------------------------------------------------
def test_recorded_events_write_the_rows_every_reader_of_ledger_jsonl_expects(tmp_path):
    """The file format is public (RunSummary.ledger, audit_ledger, the chaos checker, old runs'
    ledgers on --resume): typed events must write exactly these rows."""
    ledger = Ledger(tmp_path / "a.jsonl")
    ledger.record(L.TicketIssued(batch_id="t-000003", index=3, min_version=1))
    ledger.record(L.TicketConsumed(batch_id="t-000003", attempt=1, node="actor", policy_version=2, staleness=1))
    ledger.record(L.TicketConsumed(batch_id="t-000003", attempt=1, node="logger"))
    ledger.record(L.TicketDropped(batch_id="t-000004", node="actor", by="f", replace=False))
    ledger.record(L.TicketDropped(batch_id="t-000005", node="actor", by="f", replace=True))
    ledger.record(L.NodeDown(attempt=2, node="rollout/0/0", why="killed by SIGKILL"))
    ledger.record(L.WeightsHeld(node="rollout/0/0", version=3, digest=None))
    ledger.record(L.Replanned(host="host-b", moved={"rollout/0/0": "host-a"}))
    ledger.close()
    rows = [json.loads(x) for x in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert all(isinstance(r.pop("t"), float) for r in rows)
    assert rows == [
        {"batch_id": "t-000003", "attempt": 0, "event": "issued", "index": 3, "min_version": 1},
        {"batch_id": "t-000003", "attempt": 1, "event": "consumed", "node": "actor", "policy_version": 2, "staleness": 1},
        {"batch_id": "t-000003", "attempt": 1, "event": "consumed", "node": "logger"},
        {"batch_id": "t-000004", "attempt": 0, "event": "dropped", "node": "actor", "by": "f"},
        {"batch_id": "t-000005", "attempt": 0, "event": "dropped", "node": "actor", "by": "f", "replace": True},
        {"batch_id": "-", "attempt": 2, "event": "node_down", "node": "rollout/0/0", "why": "killed by SIGKILL"},
        {"batch_id": "-", "attempt": 0, "event": "weights", "node": "rollout/0/0", "version": 3, "digest": None},
        {"batch_id": "-", "attempt": 0, "event": "replanned", "host": "host-b", "moved": {"rollout/0/0": "host-a"}},
    ]
    assert ledger.rows == 8


def test_the_docstring_table_names_every_event_and_its_class():
    table = L.__doc__.split("Exactly once")[0]
    for name, cls in L.ledger_events().items():
        assert f"    {name} " in table and f" {cls.__name__} " in table, name
