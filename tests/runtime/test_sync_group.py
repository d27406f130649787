"""The weight-sync group on its own (flowrl/runtime/controller/weightorders.py): who an epoch is
formed of, when a new one forms, what is ordered, and when failures end the run. Fake processes."""

import anyio

from flowrl.graph.spec import WeightSyncSpec
from flowrl.runtime.controller.procs import Removal
from flowrl.runtime.controller.roles import Roles
from flowrl.runtime.controller.weightorders import SyncGroup
from flowrl.runtime.protocol import messages as m
from tests.runtime.controller_fakes import Failures, Outbox, ledger, table

ROLES = Roles(publishers=("actor",), subscribers=("rollout",))
PIDS = ("actor/0/0", "actor/0/1", "rollout/0/0", "rollout/1/0", "reward/0/0")


def group(tmp_path, *pids, max_failures=5):
    procs = table(*(pids or PIDS))
    out, fails = Outbox(), Failures()
    g = SyncGroup(procs, ROLES, send=out, fail=fails, ledger=ledger(tmp_path),
                  section=WeightSyncSpec(max_failures=max_failures, min_timeout_s=30.0, timeout_deadlines=4.0),
                  deadline_s=5.0)
    return g, procs, out, fails


def test_an_epoch_is_rank_0_of_the_publisher_then_every_subscriber_and_each_gets_its_rank(tmp_path):
    g, procs, out, _ = group(tmp_path)
    anyio.run(lambda: g.form(7))
    assert g.epoch == 1 and [p.id for p in g.members] == ["actor/0/0", "rollout/0/0", "rollout/1/0"]
    orders = [(who, s.rank, s.world_size, s.version, s.sync_epoch) for who, s in out.of(m.Sync)]
    assert orders == [("actor/0/0", 0, 3, 7, 1), ("rollout/0/0", 1, 3, 7, 1), ("rollout/1/0", 2, 3, 7, 1)]
    assert {s.timeout_s for _, s in out.of(m.Sync)} == {30.0}


def test_the_collective_timeout_is_the_longer_of_its_floor_and_the_deadlines(tmp_path):
    g, *_ = group(tmp_path)
    assert g.timeout_s() == 30.0
    g.deadline_s = 10.0
    assert g.timeout_s() == 40.0


def test_without_a_live_publisher_there_is_no_group_and_no_epoch(tmp_path):
    g, procs, out, _ = group(tmp_path)
    procs.get("actor/0/0").down_since = 1.0
    anyio.run(lambda: g.form(0))
    assert g.epoch == 0 and g.members == [] and out.sent == []


def test_a_publisher_alone_gets_a_one_member_epoch_that_fences_its_older_one(tmp_path):
    g, procs, out, _ = group(tmp_path, "actor/0/0")
    anyio.run(lambda: g.form(3))
    assert g.epoch == 1 and [(who, s.world_size) for who, s in out.of(m.Sync)] == [("actor/0/0", 1)]


def test_a_new_epoch_forms_only_when_who_can_take_part_changed_and_never_during_a_recovery(tmp_path):
    g, procs, out, _ = group(tmp_path)
    anyio.run(lambda: g.form(0))
    anyio.run(lambda: g.follow(0, recovering=False))
    assert g.epoch == 1, "same members: no new epoch"
    procs.get("rollout/1/0").down_since = 5.0
    anyio.run(lambda: g.follow(0, recovering=True))
    assert g.epoch == 1, "a recovery's end forms the epoch"
    anyio.run(lambda: g.follow(0, recovering=False))
    assert g.epoch == 2 and [p.id for p in g.members] == ["actor/0/0", "rollout/0/0"]


def test_a_wired_member_joins_once_no_other_member_is_still_starting(tmp_path):
    g, procs, out, _ = group(tmp_path)
    procs.get("rollout/1/0").wired = False
    anyio.run(lambda: g.joined(procs.get("rollout/0/0"), 0))
    assert g.epoch == 0, "rollout/1/0 is still starting: they join one epoch together"
    anyio.run(lambda: g.joined(procs.get("reward/0/0"), 0))
    assert g.epoch == 0, "not a weight process"
    procs.get("rollout/1/0").wired = True
    anyio.run(lambda: g.joined(procs.get("rollout/1/0"), 0))
    assert g.epoch == 1 and len(g.members) == 3


def test_orders_go_to_a_group_of_two_or_more_and_none_during_a_recovery(tmp_path):
    g, procs, out, _ = group(tmp_path)
    anyio.run(lambda: g.form(0))
    out.clear()
    anyio.run(lambda: g.order(4, recovering=True))
    assert out.sent == []
    anyio.run(lambda: g.order(4, recovering=False))
    assert [s.version for _, s in out.of(m.Sync)] == [4, 4, 4]
    g.disband()
    out.clear()
    anyio.run(lambda: g.order(5, recovering=False))
    assert out.sent == [] and g.identities == frozenset()


def test_failures_of_the_current_epoch_form_new_ones_until_one_too_many_fails_the_run(tmp_path):
    g, procs, out, fails = group(tmp_path, max_failures=2)
    anyio.run(lambda: g.form(0))
    sub = procs.get("rollout/0/0")
    anyio.run(lambda: g.sync_failed(sub, m.SyncFailed(sync_epoch=0, error="old"), 0, recovering=False))
    assert g.epoch == 1 and g.failures == 0, "an older epoch's round: expected, not counted"
    anyio.run(lambda: g.sync_failed(sub, m.SyncFailed(sync_epoch=1, error="e"), 0, recovering=True))
    assert g.epoch == 1 and g.failures == 0, "not counted during a recovery"
    for n in (1, 2):
        anyio.run(lambda: g.sync_failed(sub, m.SyncFailed(sync_epoch=g.epoch, error="e"), 0, recovering=False))
        assert g.failures == n and g.epoch == 1 + n and fails.why == []
    anyio.run(lambda: g.sync_failed(sub, m.SyncFailed(sync_epoch=g.epoch, error="timeout"), 0, recovering=False))
    assert fails.why and fails.why[0].startswith("weight sync failed 3 times in a row; last: timeout")


def test_a_synced_round_of_the_current_epoch_resets_the_failure_count(tmp_path):
    g, procs, out, fails = group(tmp_path)
    anyio.run(lambda: g.form(0))
    sub = procs.get("rollout/0/0")
    anyio.run(lambda: g.sync_failed(sub, m.SyncFailed(sync_epoch=g.epoch, error="e"), 0, recovering=False))
    assert g.failures == 1
    g.synced(sub, m.Synced(version=3, sync_epoch=g.epoch - 1))
    assert g.failures == 1 and sub.version == 3, "an older epoch's success does not reset"
    g.synced(sub, m.Synced(version=4, sync_epoch=g.epoch))
    assert g.failures == 0 and sub.version == 4


def test_a_permanent_failure_fails_the_run_at_once(tmp_path):
    g, procs, out, fails = group(tmp_path)
    anyio.run(lambda: g.sync_failed(procs.get("rollout/0/0"), m.SyncFailed(sync_epoch=9, error="layout", permanent=True),
                                    0, recovering=True))
    assert len(fails.why) == 1 and "cannot take the trainer's weights: layout" in fails.why[0]


def test_a_removed_member_is_dropped_and_never_a_candidate(tmp_path):
    g, procs, out, _ = group(tmp_path)
    anyio.run(lambda: g.form(0))
    gone = procs.get("rollout/1/0")
    gone.removed = Removal()
    assert gone not in g.candidates()
    g.drop(gone)
    assert gone not in g.members


def test_a_round_is_under_way_until_every_member_replied_or_it_is_old(tmp_path, monkeypatch):
    """While it is, the controller holds its metrics work (it ran beside the round on two cores)."""
    import flowrl.runtime.controller.weightorders as wo

    g, procs, out, _ = group(tmp_path)
    assert not g.in_round()
    anyio.run(lambda: g.form(4))
    assert g.in_round()
    g.synced(procs.get("actor/0/0"), m.Synced(version=4, sync_epoch=g.epoch))
    g.synced(procs.get("rollout/0/0"), m.Synced(version=4, sync_epoch=g.epoch))
    assert g.in_round(), "rollout/1/0 has not replied"
    anyio.run(lambda: g.sync_failed(procs.get("rollout/1/0"), m.SyncFailed(sync_epoch=g.epoch - 1, error="older"),
                                    4, recovering=False))
    assert not g.in_round(), "a failure is a reply too"
    anyio.run(lambda: g.order(5, recovering=False))
    assert g.in_round()
    g.drop(procs.get("rollout/1/0"))
    g.disband()
    assert not g.in_round(), "a recovery began: nobody replies to that round"
    anyio.run(lambda: g.order(6, recovering=False))  # no members: nothing ordered, nothing awaited
    assert not g.in_round()
    anyio.run(lambda: g.form(6))
    monkeypatch.setattr(wo.time, "monotonic", lambda real=wo.time.monotonic: real() + wo.ROUND_QUIET_S)
    assert not g.in_round(), "a member that never replies holds the metrics back ROUND_QUIET_S at most"
