"""The recovery epoch has one home (flowrl/runtime/controller/recovery.py): the recovery book holds
it, `begin_recovery` and `resume` advance it, and the scheduler asks for it. `Recovery` runs one
epoch: who is told to roll back, who must enter, the re-sent orders and the deadline. Fake
processes, a settable clock."""

import anyio
import pytest

from flowrl.graph.spec import RecoverySpec
from flowrl.runtime.controller.recovery import Recovery, RecoveryBook
from flowrl.runtime.controller.procs import Removal
from flowrl.runtime.controller.roles import Roles
from flowrl.runtime.controller.scheduler import Scheduler
from flowrl.runtime.protocol import messages as m
from tests.runtime.controller_fakes import Clock, Outbox, ledger, table

ROLES = Roles(sources=("src",), sinks=("actor", "log"), stateful=("actor",))
PIDS = ("src/0/0", "actor/0/0", "log/0/0")


def parts(tmp_path, *, resend_s=2.0, startup_s=60.0):
    led = ledger(tmp_path)
    book = RecoveryBook(tmp_path, ["actor/0/0"], keep=2, ledger=led)
    sched = Scheduler(steps=6, batch_size=1, max_staleness=0, sinks=list(ROLES.sinks), stateful_sinks=["actor"],
                      ticket_timeout_s=10, ledger=led, epoch=lambda: book.epoch)
    procs = table(*PIDS)
    out, clock = Outbox(), Clock()
    rec = Recovery(book, sched, procs, ROLES, send=out, ledger=led, section=RecoverySpec(epoch_resend_s=resend_s),
                   startup_timeout_s=startup_s, clock=clock)
    return book, sched, procs, rec, out, clock


def test_one_epoch_advanced_by_the_book_is_the_epoch_every_holder_sees(tmp_path):
    book, sched, procs, rec, out, _ = parts(tmp_path)
    assert book.epoch == sched.epoch == 0
    assert book.begin_recovery() == 1
    assert sched.epoch == 1 and [t.epoch for t in sched.issuable()] == [1], "tickets carry the book's epoch"
    book.resume({"step": 0, "epoch": 4, "files": {}, "version": 0})
    assert book.epoch == sched.epoch == 5, "--resume: the epoch after the checkpoint's"
    with pytest.raises(AttributeError):
        book.epoch = 9  # one writer: only begin_recovery and resume move it
    with pytest.raises(AttributeError):
        sched.epoch = 9  # the scheduler keeps no copy


def test_a_recovery_rolls_back_orders_the_ready_processes_and_waits_for_every_one(tmp_path):
    book, sched, procs, rec, out, _ = parts(tmp_path)
    procs.get("log/0/0").ready = False  # starting: gets its order when it is wired
    assert anyio.run(rec.begin, "actor/0/0 exited") == 1 and rec.active
    assert sorted(who for who, _ in out.of(m.Epoch)) == ["actor/0/0", "src/0/0"]
    assert rec.waiting == set(PIDS)
    assert not rec.entered(procs.get("actor/0/0"), 0), "a report of the old epoch does not count"
    assert not rec.entered(procs.get("actor/0/0"), 1)
    assert not rec.entered(procs.get("src/0/0"), 1)
    assert rec.entered(procs.get("log/0/0"), 1) and not rec.active, "the last one ends it"


def test_each_process_is_told_what_it_rolls_back_to(tmp_path):
    book, sched, procs, rec, out, _ = parts(tmp_path)
    (tmp_path / "checkpoints" / "step00000002").mkdir(parents=True)
    book.report("actor/0/0", step=2, epoch=0, file="step00000002/actor.0.0.e0.pt", version=2)
    book.commit(2, {})
    sched.issuable()
    sched.consumed("log", 0)  # the stateless sink has ticket 0; the stateful one not yet
    anyio.run(rec.begin, "actor/0/0 exited")
    orders = dict(out.of(m.Epoch))
    assert orders["actor/0/0"].watermark == 2 and orders["actor/0/0"].checkpoint.endswith("step00000002/actor.0.0.e0.pt")
    assert orders["log/0/0"].consumed == [0] and orders["log/0/0"].watermark == 0
    assert orders["src/0/0"] == m.Epoch(epoch=1, watermark=0)


def test_orders_go_again_to_wired_processes_that_have_not_entered_and_a_late_recovery_fails_naming_them(tmp_path):
    book, sched, procs, rec, out, clock = parts(tmp_path, resend_s=2.0, startup_s=60.0)
    anyio.run(rec.begin, "actor/0/0 exited")
    rec.entered(procs.get("actor/0/0"), 1)
    procs.get("log/0/0").wired = False
    out.clear()
    clock.now += 1.0
    assert anyio.run(rec.watch) == (False, None) and out.sent == []
    clock.now += 1.5
    assert anyio.run(rec.watch) == (False, None)
    assert [who for who, _ in out.of(m.Epoch)] == ["src/0/0"], "not yet wired: it gets its order when it is"
    clock.now += 60
    ended, why = anyio.run(rec.watch)
    assert not ended and why.startswith("recovery epoch 1 did not complete within 60 s")
    assert why.endswith("still waiting for src/0/0, log/0/0")


def test_a_removed_replica_is_not_waited_for(tmp_path):
    book, sched, procs, rec, out, clock = parts(tmp_path)
    anyio.run(rec.begin, "actor/0/0 exited")
    rec.entered(procs.get("actor/0/0"), 1)
    rec.entered(procs.get("src/0/0"), 1)
    procs.get("log/0/0").removed = Removal()
    assert anyio.run(rec.watch) == (True, None) and not rec.active


def test_a_rank_group_restarting_during_a_recovery_must_enter_it_too(tmp_path):
    book, sched, procs, rec, out, clock = parts(tmp_path)
    procs.add(table("gen/0/0").procs["gen/0/0"])
    anyio.run(rec.begin, "actor/0/0 exited")
    for pid in PIDS:
        rec.entered(procs.get(pid), 1)
    assert rec.active, "gen/0/0 was there when it began"
    rec.also_wait_for(["gen/0/0", "gen/0/1"])
    assert rec.waiting == {"gen/0/0", "gen/0/1"}
