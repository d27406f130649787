"""The scheduler's bookkeeping on its own: staleness capacity, replay, rollback, resume."""

from flowrl.runtime.scheduler import Ledger, Scheduler
from flowrl.testing import audit_ledger


def make(k=0, steps=6, sinks=("actor",)):
    return Scheduler(steps=steps, batch_size=2, max_staleness=k, sinks=list(sinks), ticket_timeout_s=10,
                     ledger=Ledger(None))


def consume_next(s, version_bump=True):
    bid = s.in_flight[0]
    assert s.consumed("actor", bid, s.tickets[bid].attempt)
    if version_bump:
        s.set_version(s.consumed_count)
    return bid


def test_staleness_k_allows_exactly_k_plus_one_tickets_in_flight():
    for k in (0, 1, 2):
        s = make(k)
        first = s.issuable()
        assert [t.index for t in first] == list(range(k + 1))
        assert [t.min_policy_version for t in first] == [0] * (k + 1)
        assert s.issuable() == []
        consume_next(s)
        (nxt,) = s.issuable()
        assert nxt.index == k + 1 and nxt.min_policy_version == 1


def test_reissue_in_flight_bumps_attempt_and_keeps_consumed_tickets():
    s = make(k=1)
    s.issuable()
    done = consume_next(s)
    s.issuable()
    again = s.reissue_in_flight("rollout/0/0 restarted")
    assert [t.attempt for t in again] == [1, 1]
    assert done not in [t.batch_id for t in again]


def test_duplicate_consumption_is_recorded_and_not_counted():
    s = make()
    (t,) = s.issuable()
    assert s.consumed("actor", t.batch_id, 0)
    assert not s.consumed("actor", t.batch_id, 1)
    assert [r["event"] for r in s.ledger.events] == ["issued", "consumed", "duplicate_dropped"]
    assert s.consumed_count == 1


def test_a_ticket_with_two_sinks_is_consumed_when_both_have_it():
    s = make(sinks=("actor", "logger"))
    (t,) = s.issuable()
    assert not s.consumed("actor", t.batch_id, 0)
    assert s.consumed("logger", t.batch_id, 0)


def test_rollback_then_replay_keeps_the_audit_exactly_once():
    s = make(k=0, steps=4)
    for _ in range(4):
        s.issuable()
        consume_next(s)
    s.rolled_back([s.batch_id(2), s.batch_id(3)], reason="actor restored from checkpoint 2")
    s.version = 2
    for t in s.reissue_in_flight("actor restarted"):
        assert s.consumed("actor", t.batch_id, t.attempt)
    audit = audit_ledger(s.ledger.events)
    assert audit.exactly_once and s.done


def test_resume_marks_only_what_the_sink_saved_as_consumed():
    s = make(k=1, steps=6)
    s.issuable()
    consume_next(s)
    state = s.state_dict()
    consume_next(s)  # consumed after the snapshot: the sink's checkpoint says so
    saved = {s.batch_id(0), s.batch_id(1)}
    r = make(k=1, steps=6)
    r.load_state_dict(state, applied=saved)
    assert r.consumed_count == 2 and r.next_index >= 2
    assert r.in_flight == []
