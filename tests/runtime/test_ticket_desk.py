"""The ticket desk on its own (flowrl/runtime/controller/tickets.py): where tickets go, what holds
them, which are void, where a ticket that ran out was last seen, and how often nodes hear
progress. Real scheduler, fake processes, a settable clock."""

import anyio

from flowrl.graph.spec import TicketDeskSpec
from flowrl.runtime.controller.procs import NodeFailure
from flowrl.runtime.controller.scheduler import Scheduler
from flowrl.runtime.controller.tickets import TicketDesk
from flowrl.runtime.protocol import messages as m
from tests.runtime.controller_fakes import Clock, Failures, Outbox, ledger, table


def desk(tmp_path, *pids, k=0, steps=6, max_attempts=10, epoch=lambda: 0, interval=0.25):
    procs = table(*pids)
    sched = Scheduler(steps=steps, batch_size=1, max_staleness=k, sinks=["sink"], ticket_timeout_s=10,
                      max_attempts=max_attempts, ledger=ledger(tmp_path), epoch=epoch)
    out, fails, clock = Outbox(), Failures(), Clock()
    d = TicketDesk(sched, procs, sources=["src"], send=out, fail=fails, ledger=sched.ledger,
                   section=TicketDeskSpec(progress_interval_s=interval), clock=clock)
    return d, sched, procs, out, fails, clock


def consumed(index, attempt=0, **kw):
    return m.Consumed(batch_id=f"t-{index:06d}", index=index, attempt=attempt, epoch=0, **kw)


def test_tickets_go_round_robin_to_the_ready_wired_rank_0_processes_of_each_source(tmp_path):
    d, sched, procs, out, _, _ = desk(tmp_path, "src/0/0", "src/1/0", "src/1/1", "src/2/0", k=3)
    procs.get("src/2/0").wired = False  # still starting: takes nothing
    anyio.run(lambda: d.flush(held=False, epoch=0))
    assert [(who, t.index) for who, t in out.of(m.TicketMsg)] == [("src/0/0", 0), ("src/1/0", 1), ("src/0/0", 2),
                                                                   ("src/1/0", 3)]
    assert d.pending == []


def test_nothing_moves_while_held_and_tickets_wait_for_a_source_that_can_take_them(tmp_path):
    d, sched, procs, out, _, _ = desk(tmp_path, "src/0/0", k=1)
    anyio.run(lambda: d.flush(held=True, epoch=0))
    assert out.sent == [] and sched.open == {}, "held (a recovery, a failure): nothing is even issued"
    procs.get("src/0/0").ready = False
    anyio.run(lambda: d.flush(held=False, epoch=0))
    assert out.sent == [] and [t.index for t in d.pending] == [0, 1]
    procs.get("src/0/0").ready = True
    anyio.run(lambda: d.flush(held=False, epoch=0))
    assert [t.index for _, t in out.of(m.TicketMsg)] == [0, 1] and d.pending == []


def test_a_waiting_ticket_of_an_older_epoch_is_dropped_not_sent(tmp_path):
    epoch = [0]
    d, sched, procs, out, _, _ = desk(tmp_path, "src/0/0", epoch=lambda: epoch[0])
    procs.get("src/0/0").ready = False
    anyio.run(lambda: d.flush(held=False, epoch=0))
    assert [t.epoch for t in d.pending] == [0]
    procs.get("src/0/0").ready = True
    epoch[0] = 1  # a rollback began an epoch
    sched.rollback(0, 0, "test")
    anyio.run(lambda: d.flush(held=False, epoch=1))
    assert [(t.index, t.epoch) for _, t in out.of(m.TicketMsg)] == [(0, 1)], "only the new epoch's ticket 0"


def test_a_ticket_past_its_attempts_fails_the_run_naming_where_it_was_last_busy_and_the_last_errors(tmp_path):
    d, sched, procs, out, fails, _ = desk(tmp_path, "src/0/0", "mid/0/0", max_attempts=2)
    anyio.run(lambda: d.flush(held=False, epoch=0))
    d.seen_busy("t-000000", "mid/0/0")
    d.seen_busy("t-000005", "src/0/0")  # not an open ticket: not recorded
    assert d.where("t-000005") is None
    procs.get("mid/0/0").error = NodeFailure("process", "ValueError", "bad batch")
    anyio.run(lambda: d.reissue(sched.reissue_open, "mid/0/0 restarted"))
    assert fails.why == []
    anyio.run(lambda: d.reissue(sched.reissue_open, "mid/0/0 restarted"))
    (why,) = fails.why
    assert "ticket t-000000 (index 0) was issued 2 times" in why
    assert "last seen inside a call at: mid/0/0" in why and "mid/0/0: process: ValueError: bad batch" in why


def refused(index, attempt, what="no tensor 'y' (has ['x'])"):
    return m.Duplicate(batch_id=f"t-{index:06d}", attempt=attempt, why=f"{m.INVALID} on a->b: {what}")


def test_a_ticket_refused_at_two_attempts_fails_the_run_naming_why_and_one_refusal_only_warns(tmp_path, caplog):
    d, sched, procs, out, fails, _ = desk(tmp_path, "src/0/0", k=1)
    anyio.run(lambda: d.flush(held=False, epoch=0))
    d.dropped("mid/0/0", m.Duplicate(batch_id="t-000000", attempt=0, why="duplicate"))  # not a refusal
    d.dropped("mid/0/0", refused(7, 0))  # no open ticket of the run (a forgery): nothing
    d.dropped("mid/0/0", refused(7, 1))
    for attempt in (0, 1):  # ticket 0's index, another run's id: nothing
        d.dropped("mid/0/0", m.Duplicate(batch_id="x-000000", attempt=attempt, why=f"{m.INVALID} on a->b: y"))
    d.dropped("mid/0/0", refused(0, 0))
    d.dropped("mid/0/0", refused(0, 0))  # the same attempt again (a second copy): still one
    assert fails.why == [] and "mid/0/0 refused t-000000 (attempt 0): invalid on a->b" in caplog.text
    d.dropped("mid/0/0", refused(1, 0))
    assert d.consumed("sink", consumed(1, policy_version=0, staleness=0)) is True  # the real batch was taken
    d.dropped("mid/0/0", refused(1, 1))  # (a late forgery of a completed ticket)
    assert fails.why == []
    d.dropped("mid/0/0", refused(0, 1))
    (why,) = fails.why
    assert "mid/0/0 refused t-000000 at attempts 0 and 1: invalid on a->b: no tensor 'y'" in why
    assert "make the producer emit it, or change the node's `requires`" in why


def test_a_ticket_that_runs_out_names_the_refusal_among_the_last_errors(tmp_path):
    d, sched, procs, out, fails, _ = desk(tmp_path, "src/0/0", max_attempts=1)
    anyio.run(lambda: d.flush(held=False, epoch=0))
    d.dropped("mid/0/0", refused(0, 0))
    anyio.run(lambda: d.reissue(sched.reissue_open, "mid/0/0 restarted"))
    (why,) = fails.why
    assert "was issued 1 times" in why and "mid/0/0 refused it: invalid on a->b: no tensor 'y'" in why


def test_a_completed_ticket_is_forgotten_where_it_was_busy_and_only_completion_counts_as_a_step(tmp_path):
    d, sched, procs, out, _, _ = desk(tmp_path, "src/0/0")
    anyio.run(lambda: d.flush(held=False, epoch=0))
    d.seen_busy("t-000000", "src/0/0")
    assert d.consumed("sink", consumed(0, policy_version=0, staleness=0)) is True
    assert d.where("t-000000") is None
    assert d.consumed("sink", consumed(0)) is False, "a second report of the same ticket is no step"


def test_progress_goes_to_wired_nodes_at_most_once_per_interval_and_at_once_when_the_end_moved(tmp_path):
    d, sched, procs, out, _, clock = desk(tmp_path, "src/0/0", "sink/0/0", interval=0.25)
    procs.get("sink/0/0").wired = False
    anyio.run(d.progress)
    assert [(who, msg.complete_below) for who, msg in out.of(m.Progress)] == [("src/0/0", 0)]
    out.clear()
    anyio.run(lambda: d.flush(held=False, epoch=0))
    d.consumed("sink", consumed(0, policy_version=0, staleness=0))
    clock.now += 0.2
    anyio.run(d.progress)
    assert out.of(m.Progress) == [], "within the interval"
    clock.now += 0.1
    anyio.run(d.progress)
    assert [msg.complete_below for _, msg in out.of(m.Progress)] == [1]
    out.clear()
    clock.now += 10
    anyio.run(d.progress)
    assert out.of(m.Progress) == [], "nothing new to say"
    sched.base_steps += 1  # the end moved (as a replaced ticket moves it)
    assert d.end_moved()
    anyio.run(d.progress)
    assert [msg.steps for _, msg in out.of(m.Progress)] == [7] and not d.end_moved()
