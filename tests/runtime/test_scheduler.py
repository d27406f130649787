"""The scheduler's bookkeeping on its own: staleness capacity, per-sink consumption, re-issue,
attempt limits, rollback and resume — with the ledger audited after each story."""

import pytest

from flowrl.runtime.protocol.indexset import IndexSet
from flowrl.runtime.protocol.ledger import Ledger, audit_ledger, read_jsonl
from flowrl.runtime.controller.scheduler import Scheduler, TicketExhausted


@pytest.fixture
def ledger_path(tmp_path):
    return tmp_path / "ledger.jsonl"


def make(path, k=0, steps=6, sinks=("actor",), stateful=("actor",), max_attempts=10, epoch=lambda: 0):
    return Scheduler(steps=steps, batch_size=2, max_staleness=k, sinks=list(sinks), stateful_sinks=list(stateful),
                     ticket_timeout_s=10, max_attempts=max_attempts, ledger=Ledger(path), epoch=epoch)


def rows(s):
    s.ledger.flush()
    return read_jsonl(s.ledger.path)


def consume_next(s, sinks=("actor",)):
    i = min(s.open)
    done = [s.consumed(sink, i, s.open[i].attempt) for sink in sinks]
    s.set_version(s.completed)
    return i, done[-1]


def test_staleness_k_allows_exactly_k_plus_one_tickets_in_flight(ledger_path):
    for k in (0, 1, 2):
        s = make(ledger_path, k)
        first = s.issuable()
        assert [t.index for t in first] == list(range(k + 1))
        assert [t.min_policy_version for t in first] == [0] * (k + 1)
        assert s.issuable() == []
        consume_next(s)
        (nxt,) = s.issuable()
        assert nxt.index == k + 1 and nxt.min_policy_version == 1


def test_reissue_open_bumps_attempt_and_keeps_complete_tickets(ledger_path):
    s = make(ledger_path, k=1)
    s.issuable()
    done, _ = consume_next(s)
    s.issuable()
    again = s.reissue_open("rollout/0/0 restarted")
    assert [t.attempt for t in again] == [1, 1]
    assert done not in [t.index for t in again]


def test_duplicate_consumption_by_one_sink_is_recorded_and_not_counted(ledger_path):
    s = make(ledger_path)
    (t,) = s.issuable()
    assert s.consumed("actor", t.index, 0)
    assert not s.consumed("actor", t.index, 1)
    assert [r["event"] for r in rows(s)] == ["issued", "consumed", "completed", "duplicate_dropped"]
    assert s.completed == 1


def test_a_ticket_is_complete_only_when_every_sink_has_it_and_each_sink_counts_once(ledger_path):
    s = make(ledger_path, sinks=("actor", "logger"), stateful=("actor",))
    (t,) = s.issuable()
    assert not s.consumed("actor", t.index, 0)
    assert not s.consumed("actor", t.index, 0)  # the same sink again: a duplicate, not completion
    assert s.consumed("logger", t.index, 0, dropped_by="filter: no variance")
    audit = audit_ledger(rows(s), sinks=["actor", "logger"])
    assert audit.exactly_once


def test_a_ticket_reissued_past_max_attempts_fails_naming_it(ledger_path):
    s = make(ledger_path, max_attempts=3)
    (t,) = s.issuable()
    s.timed_out(now=1e12)
    s.timed_out(now=2e12)
    with pytest.raises(TicketExhausted) as e:
        s.timed_out(now=3e12)
    assert e.value.batch_id == t.batch_id and e.value.attempts == 3 and "timeout" in str(e.value)


def test_rollback_replays_from_the_checkpoint_for_stateful_sinks_only(ledger_path):
    epoch = [0]  # the recovery book's epoch: the scheduler asks, never keeps it
    s = make(ledger_path, k=0, steps=6, sinks=("actor", "logger"), stateful=("actor",), epoch=lambda: epoch[0])
    for _ in range(4):
        s.issuable()
        consume_next(s, sinks=("actor", "logger"))
    epoch[0] = 1  # book.begin_recovery()
    s.rollback(2, version=2, reason="critic/0/0 exited")
    assert s.complete_below == 2 and s.next_index == 2 and s.version == 2
    replay = s.issuable()
    assert [(t.index, t.attempt, t.epoch) for t in replay] == [(2, 1, 1)]
    # the logger (no state) keeps what it consumed: only the actor consumes 2 and 3 again
    assert s.consumed_above("logger", 2) == [2, 3]
    while not s.done:
        i, _ = consume_next(s, sinks=("actor",)) if min(s.open) < 4 else consume_next(s, sinks=("actor", "logger"))
        s.issuable()
    audit = audit_ledger(rows(s), sinks=["actor", "logger"])
    assert audit.exactly_once, (audit.lost, audit.duplicated)
    assert sum(1 for r in rows(s) if r["event"] == "rolled_back") == 2


def test_resume_rebuilds_consumption_from_the_ledger_after_the_checkpoint(ledger_path):
    s = make(ledger_path, k=1, steps=6, sinks=("actor", "logger"), stateful=("actor",))
    s.issuable()
    for _ in range(3):
        consume_next(s, sinks=("actor", "logger"))
        s.issuable()
    s.consumed("logger", min(s.open), 0)  # the logger ran ahead of the actor
    s.ledger.close()
    r = make(ledger_path, k=1, steps=6, sinks=("actor", "logger"), stateful=("actor",))
    r.resume(2, version=2, ledger_rows=read_jsonl(ledger_path))
    assert r.complete_below == 2 and r.consumed_above("logger", 2) == [2, 3] and r.consumed_above("actor", 2) == []
    assert [t.index for t in r.issuable()] == [2, 3]


def test_state_and_per_call_work_stay_small_over_many_steps(ledger_path):
    s = Scheduler(steps=100_000, batch_size=1, max_staleness=2, sinks=["a", "b"], stateful_sinks=["a"],
                  ticket_timeout_s=10, ledger=Ledger(None))
    for _ in range(100_000 // 3):
        for t in s.issuable():
            s.consumed("b", t.index)
            s.consumed("a", t.index)
        s.set_version(s.completed)
    assert len(s.open) <= 3 and not s.complete.extras and not s.attempts
    assert all(not c.extras for c in s.consumed_by.values())


def test_index_set_keeps_a_watermark_and_the_few_above_it():
    x = IndexSet()
    for i in (0, 2, 3):
        x.add(i)
    assert x.low == 1 and x.extras == {2, 3}
    assert x.add(1) and x.low == 4 and not x.extras
    assert not x.add(2)
    assert x.truncate(2) == [2, 3] and x.low == 2
    assert x.above(0) == [0, 1]


REPLACE = "[replace] dapo: 1/4 groups, waiting for more"


def test_a_ticket_dropped_with_replace_adds_one_ticket_so_the_run_keeps_its_updates(ledger_path):
    s = make(ledger_path, k=0, steps=4)
    s.issuable()
    for i in range(3):  # tickets 1 and 2 are held for later batches: the run grows to 6 tickets
        assert s.consumed("actor", i, 0, dropped_by=REPLACE if i in (1, 2) else None)
        s.set_version(s.completed)
        s.issuable()
    assert s.steps == 6
    while not s.done:
        consume_next(s)
        s.issuable()
    assert s.completed == 6 and s.next_index == 6
    events = rows(s)
    assert [r["batch_id"] for r in events if r["event"] == "replaced"] == ["t-000001", "t-000002"]
    assert sum(1 for r in events if r["event"] == "consumed") == 4  # four training updates, as asked
    assert audit_ledger(events, sinks=["actor"]).exactly_once
    assert s.consumed("actor", 6, 0) is False  # past the (grown) end is still refused


def test_replacements_are_bounded_and_past_the_bound_a_replace_drop_is_a_plain_drop(ledger_path):
    s = Scheduler(steps=3, batch_size=2, max_staleness=0, sinks=["actor"], stateful_sinks=["actor"],
                  ticket_timeout_s=10, ledger=Ledger(ledger_path), max_replaced=2)
    while not s.done:
        for t in s.issuable():
            s.consumed("actor", t.index, 0, dropped_by=REPLACE)
            s.set_version(s.completed)
    assert s.steps == 5 and s.replace_refused == 3
    assert sum(1 for r in rows(s) if r["event"] == "replace_refused") == 3


def test_a_rollback_undoes_replacements_made_after_the_checkpoint_and_keeps_those_before(ledger_path):
    s = make(ledger_path, k=0, steps=6, sinks=("actor", "logger"), stateful=("actor",))
    for i in range(5):
        s.issuable()
        drop = REPLACE if i in (1, 3) else None
        s.consumed("logger", i, 0, dropped_by=drop)
        s.consumed("actor", i, 0, dropped_by=drop)
        s.set_version(s.completed)
    assert s.steps == 8
    assert s.state_dict(2)["replaced_below"] == 1  # the checkpoint at 2 counts ticket 1 as replaced
    s.rollback(2, version=2, reason="actor/0/0 exited")
    assert s.steps == 7  # ticket 3 is open again; the logger's replace mark is kept for it
    for t in s.issuable():
        s.consumed("actor", t.index, t.attempt)
    assert s.steps == 7
    s.set_version(s.completed)
    while not s.done:  # ticket 3 completes again when the actor drops it again: replaced once more
        i = min(s.issuable() and s.open)
        s.consumed("actor", i, s.open[i].attempt, dropped_by=REPLACE if i == 3 else None)
        if i >= 5:
            s.consumed("logger", i, 0)
        s.set_version(s.completed)
    assert s.steps == 8 and s.completed == 8
    assert audit_ledger(rows(s), sinks=["actor", "logger"]).exactly_once


def test_resume_counts_the_replacements_of_the_checkpoint_and_those_stateless_sinks_made_after(ledger_path):
    s = make(ledger_path, k=0, steps=4, sinks=("actor", "logger"), stateful=("actor",))
    for i in range(3):
        s.issuable()
        s.consumed("logger", i, 0, dropped_by=REPLACE if i in (0, 2) else None)
        s.consumed("actor", i, 0, dropped_by=REPLACE if i in (0, 2) else None)
        s.set_version(s.completed)
    state = s.state_dict(2)
    s.ledger.close()
    r = make(ledger_path, k=0, steps=4, sinks=("actor", "logger"), stateful=("actor",))
    r.resume(2, version=2, ledger_rows=read_jsonl(ledger_path), replaced_below=state["replaced_below"])
    assert r.steps == 5  # ticket 0 (before the checkpoint); ticket 2 is the actor's to redo
    t = r.issuable()[0]
    r.consumed("actor", t.index, t.attempt, dropped_by=REPLACE)
    assert r.steps == 6


def test_resume_undoes_the_replacements_past_its_checkpoint_in_the_ledger(ledger_path):
    s = make(ledger_path, k=0, steps=4, sinks=("actor",), stateful=("actor",))
    for i in range(4):
        s.issuable()
        s.consumed("actor", i, 0, dropped_by=REPLACE if i == 3 else None)
        s.set_version(s.completed)
    s.ledger.close()
    r = make(ledger_path, k=0, steps=4, sinks=("actor",), stateful=("actor",))
    r.resume(2, version=2, ledger_rows=read_jsonl(ledger_path))
    events = rows(r)
    net = sum(1 for e in events if e["event"] == "replaced") - sum(1 for e in events if e["event"] == "replace_undone")
    assert net == 0 and r.steps == 4  # ticket 3 is the actor's to redo; its replacement is decided again


def test_a_sink_may_still_report_a_ticket_above_an_end_a_rollback_moved_back(ledger_path):
    s = make(ledger_path, k=0, steps=2, sinks=("actor", "logger"), stateful=("actor",))
    for i in range(2):
        s.issuable()
        s.consumed("logger", i, 0, dropped_by=REPLACE if i == 1 else None)
        s.consumed("actor", i, 0, dropped_by=REPLACE if i == 1 else None)
        s.set_version(s.completed)
    t = s.issuable()[0]
    assert t.index == 2 and s.steps == 3
    s.rollback(1, version=1, reason="actor/0/0 exited")
    assert s.steps == 2  # ticket 1 is open again (the logger's replace mark on it stays)
    s.consumed("logger", 2, 0)  # late, from before the rollback, above today's end: recorded, not lost
    assert s.consumed_above("logger", 0) == [0, 1, 2]
    s.issuable()
    s.consumed("actor", 1, 1, dropped_by=REPLACE)
    assert s.steps == 3 and s.consumed_above("logger", 0) == [0, 1, 2]


def test_group_tickets_take_their_updates_version_and_stay_within_k_plus_one_updates(ledger_path):
    # ticket: group with 3 groups per update: tickets 0-2 feed update 0, 3-5 update 1, ...
    s = Scheduler(steps=12, batch_size=1, max_staleness=1, tickets_per_update=3, sinks=["actor"],
                  stateful_sinks=["actor"], ticket_timeout_s=10, ledger=Ledger(ledger_path))
    first = s.issuable()
    assert [t.index for t in first] == [0, 1, 2, 3, 4, 5]  # (k + 1) updates' groups
    assert [t.min_policy_version for t in first] == [0, 0, 0, 0, 0, 0] and {t.size for t in first} == {1}
    for i in range(3):
        s.consumed("actor", i, 0)
    assert s.issuable() == []  # update 0 done, but version 1 is not published yet
    s.set_version(1)
    later = s.issuable()
    assert [(t.index, t.min_policy_version) for t in later] == [(6, 1), (7, 1), (8, 1)]
    issued = [(r["index"], r["min_version"]) for r in rows(s) if r["event"] == "issued"]
    assert issued == [(i, i // 3 - 1 if i >= 6 else 0) for i in range(9)]
