"""Replaced tickets on their own (no scheduler, no processes): each replace drop adds at most one
ticket, never more than the limit in all, a rollback undoes what it reaches and a commit keeps
what it passed — with every decision in the ledger."""

import pytest

from flowrl.runtime.controller.replacements import Replacements
from flowrl.runtime.protocol.ledger import Ledger, read_jsonl


@pytest.fixture
def book(tmp_path):
    return Replacements(limit=3, ledger=Ledger(tmp_path / "ledger.jsonl"), batch_id=lambda i: f"t-{i:06d}")


def events(r, name):
    r.ledger.flush()
    return [row for row in read_jsonl(r.ledger.path) if row["event"] == name]


def test_a_ticket_without_a_replace_marker_adds_nothing(book):
    assert book.completed(0, 0, base_steps=4) is False
    assert book.added == 0 and events(book, "replaced") == []


def test_a_replace_drop_adds_one_ticket_however_many_sinks_asked(book):
    book.mark(2, "actor")
    book.mark(2, "logger")
    assert book.completed(2, 1, base_steps=4) is True
    assert book.added == 1
    assert book.completed(2, 1, base_steps=4) is False, "a ticket is replaced once"
    [row] = events(book, "replaced")
    assert row["batch_id"] == "t-000002" and row["attempt"] == 1 and row["steps"] == 5


def test_past_the_limit_a_replace_drop_is_refused_and_counted(book):
    for i in range(5):
        book.mark(i, "actor")
        book.completed(i, 0, base_steps=4)
    assert book.added == 3 and book.refused == 2
    assert [r["steps"] for r in events(book, "replaced")] == [5, 6, 7]
    assert [r["limit"] for r in events(book, "replace_refused")] == [3, 3]


def test_a_commit_folds_what_it_passed_into_a_number_that_still_counts_against_the_limit(book):
    for i in (1, 3):
        book.mark(i, "actor")
        book.completed(i, 0, base_steps=4)
    assert book.commit(3) == 1 and book.added == 2, "ticket 3 is at the commit: not passed yet"
    book.rollback(0, ["actor"], "cannot reach below the commit")  # the replacement below 3 stays
    assert book.added == 1 and book.below == 1
    for i in (3, 5, 6):
        book.mark(i, "actor")
        book.completed(i, 0, base_steps=4)
    assert book.added == 3 and book.refused == 1


def test_a_rollback_undoes_replacements_it_reaches_and_keeps_stateless_sinks_markers(book):
    for i in (1, 3):
        book.mark(i, "actor")
        book.mark(i, "logger")
        book.completed(i, 0, base_steps=6)
    book.mark(4, "actor")  # open: only the actor has dropped it so far
    book.rollback(3, restored=["actor"], reason="actor/0/0 exited")  # reaches ticket 3 itself
    assert book.added == 1, "ticket 3's replacement is undone, ticket 1's kept"
    assert [r["batch_id"] for r in events(book, "replace_undone")] == ["t-000003"]
    assert book.marks == {3: {"logger"}}, "the restored actor's markers are gone; the logger's stay"
    assert book.completed(3, 1, base_steps=6) is True, "replaced again once it completes again"
    assert book.added == 2


def test_resume_starts_from_the_checkpoints_count_and_records_what_it_undid(book):
    book.mark(7, "actor")
    book.completed(7, 0, base_steps=6)
    book.resume(2)
    assert book.added == 2 and book.marks == {} and book.replaced == {}
    book.undone_on_resume([9, 8])
    assert [r["batch_id"] for r in events(book, "replace_undone")] == ["t-000008", "t-000009"]
    assert all(r["reason"] == "resume" for r in events(book, "replace_undone"))
