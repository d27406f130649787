"""Restarts on their own (flowrl/runtime/controller/restarts.py): a process that went down is
restarted by its policy with its whole rank group, moved off a lost host first, or fails the run.
A real supervisor over fake process handles; no processes."""

import time
from types import SimpleNamespace

import pytest

from flowrl.graph.spec import FailurePolicy, SupervisionSpec
from flowrl.runtime.controller.report import RunReport
from flowrl.runtime.controller.procs import NodeFailure
from flowrl.runtime.controller.restarts import PEER_LOSS_GRACE_S, Restarts
from flowrl.runtime.controller.supervisor import Supervisor
from flowrl.runtime.launch.launcher import ProcessHandle
from flowrl.runtime.protocol.ledger import read_jsonl
from tests.runtime.controller_fakes import Failures, ledger, table


class Handle(ProcessHandle):
    def __init__(self, pid=100):
        self.pid, self.code, self.stopped, self.released = pid, None, None, False

    def release(self):
        self.released = True

    def poll(self):
        return self.code

    def stop(self, grace):
        self.stopped, self.code = grace, -15

    def signal(self, sig):
        self.code = -sig


class Launcher:
    def __init__(self, lost=()):
        self.lost, self.started = set(lost), []

    def start(self, spec_path, log_path):
        self.started.append(spec_path.stem)
        return Handle()

    def is_lost(self, host):
        return host in self.lost

    def is_remote(self, host):
        return host != "local"

    def free_port(self, address):
        from flowrl.runtime.protocol.addresses import free_port

        return free_port(address)


def restarts(tmp_path, *pids, policy="restart", lost=(), replan=lambda host: None):
    (tmp_path / "procs").mkdir(exist_ok=True)
    procs = table(*pids)
    for p in procs:
        p.handle, p.last_seen = Handle(), time.monotonic()  # alive and beating
    launcher, fails, prepared = Launcher(lost), Failures(), []
    nodes = {p.spec.node for p in procs}
    sup = Supervisor(launcher, tmp_path, SupervisionSpec(), {n: FailurePolicy(policy=policy, backoff_s=1.0) for n in nodes})
    led = ledger(tmp_path)
    r = Restarts(sup, launcher, procs, wiring=SimpleNamespace(prepare_start=lambda p: prepared.append(p.id)),
                 report=RunReport(None, tmp_path), ledger=led, fail=fails, replan=replan)
    return r, procs, launcher, fails, prepared, led


def test_a_dead_rank_takes_its_rank_group_down_and_they_restart_together_on_a_new_master_port(tmp_path):
    r, procs, launcher, fails, _, led = restarts(tmp_path, "actor/0/0", "actor/0/1", "actor/1/0")
    dead, mate, other = procs.get("actor/0/0"), procs.get("actor/0/1"), procs.get("actor/1/0")
    dead.handle.code = 1
    assert r.down() == [(dead, "exited")]
    assert r.on_down(dead, "exited") is True and fails.why == []
    assert mate.handle.stopped == 0.5 and mate.down_since is not None and not mate.ready
    assert mate.restart.at == dead.restart.at is not None, "they start again together"
    assert mate.spec.env["MASTER_PORT"] == dead.spec.env["MASTER_PORT"] and other.spec.env == {}
    assert other.handle.stopped is None, "another replica goes on"
    led.flush()
    assert [(row["node"], row["why"]) for row in read_jsonl(led.path) if row["event"] == "node_down"] == [
        ("actor/0/0", "exited"), ("actor/0/1", "its rank group lost actor/0/0")]


GLOO_RESET = NodeFailure("process", "RuntimeError", "[third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                         "[127.0.0.1]:7873: Connection reset by peer")


def test_the_rank_that_died_is_named_not_the_rank_whose_collective_broke_because_it_did(tmp_path):
    # both are seen down in one check, the survivor first in process order (what a killed rank of a
    # data-parallel actor looked like: its partner's gloo read failed, it reported that and exited)
    r, procs, _, fails, _, led = restarts(tmp_path, "actor/0/0", "actor/0/1")
    survivor, killed = procs.get("actor/0/0"), procs.get("actor/0/1")
    survivor.handle.code, survivor.error = 1, GLOO_RESET
    killed.handle.code = -9
    assert r.down() == [(killed, "exited"), (survivor, "exited")]
    assert r.on_down(killed, "exited") is True and fails.why == []
    assert survivor.down_since is not None, "taken down with the group: the controller skips its entry"
    led.flush()
    assert [(row["node"], row["why"]) for row in read_jsonl(led.path) if row["event"] == "node_down"] == [
        ("actor/0/1", "exited"), ("actor/0/0", "its rank group lost actor/0/1")]


def test_a_rank_that_lost_a_peer_waits_a_moment_for_the_peer_to_be_seen_down(tmp_path):
    for peer_seen in (True, False):
        r, procs, _, _, _, _ = restarts(tmp_path, "actor/0/0", "actor/0/1", "actor/1/0")
        survivor, peer, other = procs.get("actor/0/0"), procs.get("actor/0/1"), procs.get("actor/1/0")
        survivor.handle.code, survivor.error = 1, GLOO_RESET
        other.handle.code, other.error = 1, GLOO_RESET  # a replica alone in its group: nobody to wait for
        t = time.monotonic()
        peer.last_seen = t  # it beat just now (not silent for a whole grace: not named)
        assert r.down(now=t) == [(other, "exited")], "the peer's exit is not seen yet: the survivor waits"
        assert r.down(now=t + PEER_LOSS_GRACE_S / 2) == [(other, "exited")]
        if peer_seen:  # a check later (a rank on another host)
            peer.handle.code = -9
            assert r.down(now=t + PEER_LOSS_GRACE_S * 0.6) == [(peer, "exited"), (survivor, "exited"),
                                                               (other, "exited")]
        else:  # never seen: the survivor goes down once the grace is over
            assert r.down(now=t + PEER_LOSS_GRACE_S * 0.9) == [(other, "exited")]
            assert r.down(now=t + PEER_LOSS_GRACE_S * 1.1) == [(survivor, "exited"), (other, "exited")]


def test_a_rank_that_failed_on_its_own_is_not_held_back(tmp_path):
    r, procs, _, _, _, _ = restarts(tmp_path, "actor/0/0", "actor/0/1")
    bug = procs.get("actor/0/0")
    bug.handle.code, bug.error = 1, NodeFailure("process", "ValueError", "shapes do not match")
    assert r.down() == [(bug, "exited")]


def test_a_node_whose_policy_is_fail_fails_the_run(tmp_path):
    r, procs, _, fails, _, _ = restarts(tmp_path, "actor/0/0", policy="fail")
    assert r.on_down(procs.get("actor/0/0"), "exited") is False
    assert len(fails.why) == 1 and "its failure policy is `fail`" in fails.why[0]


def test_a_restart_is_the_next_incarnation_from_its_start_point(tmp_path):
    r, procs, launcher, fails, prepared, _ = restarts(tmp_path, "rollout/0/0")
    p = procs.get("rollout/0/0")
    r.on_down(p, "exited")
    assert r.due() == [], "its backoff (1 s) has not passed"
    p.restart.at = 0.0  # its backoff passed
    (due,) = r.due()
    old = p.handle
    r.restart(due)
    assert p.spec.incarnation == 1 and prepared == ["rollout/0/0"] and launcher.started == ["rollout.0.0"]
    assert old.released and p.handle is not old, "what the launcher held for the last incarnation is freed"
    assert p.handle.code is None and p.down_since is None


def test_a_process_of_a_lost_host_is_moved_first_or_the_run_fails_with_why(tmp_path):
    moved = []
    r, procs, launcher, fails, prepared, _ = restarts(tmp_path, "rollout/0/0", lost={"local"},
                                                      replan=lambda host: moved.append(host))
    r.restart(procs.get("rollout/0/0"))
    assert moved == ["local"] and launcher.started == ["rollout.0.0"]
    r, procs, launcher, fails, prepared, _ = restarts(tmp_path, "rollout/0/0", lost={"local"},
                                                      replan=lambda host: f"{host} is gone and nothing fits")
    r.restart(procs.get("rollout/0/0"))
    assert launcher.started == [] and prepared == [] and fails.why == ["local is gone and nothing fits"]


class Recording:
    """What the controller's `on_down` asks of the rest of the controller."""

    def __init__(self):
        self.recoveries, self.follows, self.turns_down = [], [], []

    async def begin_recovery(self, reason):
        self.recoveries.append(reason)

    async def follow(self, version, recovering):
        self.follows.append(version)

    async def down(self, proc):
        self.turns_down.append(proc.id)


@pytest.mark.anyio
async def test_processes_seen_down_together_make_one_recovery_epoch_and_one_record_each(tmp_path):
    """A lost host, or a killed rank whose partner exited with it: one rollback of every stateful
    node, not one per process (each fenced the one before and loaded every checkpoint again)."""
    from flowrl.runtime.controller.controller import Controller

    r, procs, _, fails, _, led = restarts(tmp_path, "actor/0/0", "actor/0/1", "critic/0/0", "reward/0/0")
    survivor, killed, critic, reward = (procs.get(x) for x in ("actor/0/0", "actor/0/1", "critic/0/0", "reward/0/0"))
    survivor.handle.code, survivor.error = 1, GLOO_RESET
    for p in (killed, critic, reward):
        p.handle.code = -9
    seen = Recording()
    ctl = SimpleNamespace(restarts=r, wiring=SimpleNamespace(turns=seen), begin_recovery=seen.begin_recovery,
                          roles=SimpleNamespace(stateful={"actor", "critic"}), recovery=SimpleNamespace(active=False),
                          sync=seen, scheduler=SimpleNamespace(version=3))
    await Controller.on_down(ctl, r.down())
    assert fails.why == []
    assert seen.recoveries == ["actor/0/1 exited; critic/0/0 exited"] and seen.follows == []
    assert seen.turns_down == ["actor/0/1", "critic/0/0", "reward/0/0"], "the survivor went down with its group"
    led.flush()
    assert [(row["node"], row["why"]) for row in read_jsonl(led.path) if row["event"] == "node_down"] == [
        ("actor/0/1", "exited"), ("actor/0/0", "its rank group lost actor/0/1"), ("critic/0/0", "exited"),
        ("reward/0/0", "exited")]
    assert [p.restart.count for p in (survivor, killed, critic, reward)] == [0, 1, 1, 1]


@pytest.mark.anyio
async def test_the_first_process_of_a_lost_host_seen_down_takes_the_hosts_other_processes_down_in_the_same_tick(tmp_path):
    """Host b left the cluster: its actor's exit is seen, its critic still looks alive (its heartbeat
    deadline, or Ray's report of its actor, would come a check later). Both go down now, in one
    recovery epoch; a process of another host, and one of b already restarting, are left alone."""
    from flowrl.runtime.controller.controller import Controller

    r, procs, launcher, fails, _, led = restarts(tmp_path, "actor/0/0", "critic/0/0", "rollout/0/0", "reward/0/0",
                                                 lost={"b"})
    actor, critic, rollout, reward = (procs.get(x) for x in ("actor/0/0", "critic/0/0", "rollout/0/0", "reward/0/0"))
    for p in (actor, critic, reward):
        p.spec.host = "b"
    rollout.spec.host = "a"
    reward.restart.at = time.monotonic() + 60  # already on its way back (its restart moves it)
    actor.handle.code = -9
    down = r.down()
    assert down == [(actor, "exited"), (critic, "its host b left the cluster")]
    seen = Recording()
    ctl = SimpleNamespace(restarts=r, wiring=SimpleNamespace(turns=seen), begin_recovery=seen.begin_recovery,
                          roles=SimpleNamespace(stateful={"actor", "critic"}), recovery=SimpleNamespace(active=False),
                          sync=seen, scheduler=SimpleNamespace(version=3))
    await Controller.on_down(ctl, down)
    assert fails.why == [] and seen.recoveries == ["actor/0/0 exited; critic/0/0 its host b left the cluster"]
    assert critic.handle.released and critic.handle.stopped is None, "its actor is dropped: nothing to stop or wait for"
    assert critic.restart.count == 1
    assert rollout.handle.stopped is None and rollout.down_since is None
    assert r.down() == [], "nothing of host b is seen down a second time"
    # a host that is still there: a process that exits takes nobody with it
    r, procs, *_ = restarts(tmp_path, "actor/0/0", "critic/0/0")
    procs.get("actor/0/0").handle.code = 1
    assert [p.id for p, _ in r.down()] == ["actor/0/0"]


def test_a_rank_whose_collective_gave_up_on_a_silent_peer_names_that_peer_hung_before_its_deadline(tmp_path):
    """actor/0/1 is SIGSTOPped: no heartbeat, no exit. actor/0/0's collective times out and it exits
    with gloo's error long before actor/0/1's heartbeat deadline. After the survivor's grace (the
    peer's exit is not seen: it did not exit), the hung one is named (first, and its restart is the
    one counted); the survivor goes down with its group."""
    r, procs, _, fails, _, led = restarts(tmp_path, "actor/0/0", "actor/0/1", "actor/1/0")
    survivor, hung, other = procs.get("actor/0/0"), procs.get("actor/0/1"), procs.get("actor/1/0")
    t = time.monotonic()
    hung.last_seen = t - 2.0  # deadline_s is 5 s: check() alone would not see it for 2 s more
    other.last_seen = t - 2.0  # silent too, but of another replica: not this group's business
    survivor.handle.code, survivor.error = 1, GLOO_RESET
    assert r.down(now=t) == [], "within its grace the survivor waits, as for a peer killed a moment ago"
    down = r.down(now=t + PEER_LOSS_GRACE_S)
    assert [p.id for p, _ in down] == ["actor/0/1", "actor/0/0"]
    assert down[0][1] == ("sent no heartbeat for 3.0 s while its rank group's collective waited for it "
                          "(actor/0/0 gave up on it)")
    for proc, why in down:
        if proc.down_since is None:
            assert r.on_down(proc, why)
    assert hung.handle.stopped == 0.5 and other.handle.stopped is None and fails.why == []
    assert (hung.restart.count, survivor.restart.count) == (1, 0), "the hung one's budget pays for it"
    led.flush()
    assert [(row["node"], row["why"]) for row in read_jsonl(led.path) if row["event"] == "node_down"] == [
        ("actor/0/1", down[0][1]), ("actor/0/0", "its rank group lost actor/0/1")]
    # a mate that beats (its last heartbeat a beat ago) is not called hung: the survivor waits for it
    r, procs, *_ = restarts(tmp_path, "actor/0/0", "actor/0/1")
    survivor = procs.get("actor/0/0")
    survivor.handle.code, survivor.error = 1, GLOO_RESET
    t = time.monotonic()
    assert r.down(now=t) == []
    procs.get("actor/0/1").last_seen = t + PEER_LOSS_GRACE_S - 0.5
    assert r.down(now=t + PEER_LOSS_GRACE_S) == [(survivor, "exited")]


def test_in_a_group_of_three_the_silent_rank_is_named_not_one_of_the_two_whose_collectives_gave_up(tmp_path):
    """Both survivors of a 3-rank group exit with gloo's error in one check. Neither is the cause,
    so neither lets the other off the grace; after it, the silent rank is named."""
    r, procs, *_ = restarts(tmp_path, "actor/0/0", "actor/0/1", "actor/0/2")
    a, silent, c = procs.get("actor/0/0"), procs.get("actor/0/1"), procs.get("actor/0/2")
    t = time.monotonic()
    silent.last_seen = t - 2.0
    for p in (a, c):
        p.handle.code, p.error = 1, GLOO_RESET
    assert r.down(now=t) == []
    down = r.down(now=t + PEER_LOSS_GRACE_S)
    assert [p.id for p, _ in down] == ["actor/0/1", "actor/0/0", "actor/0/2"]
    # a rank of the three that exited on its own (not a collective's error) is the cause: no wait
    r, procs, *_ = restarts(tmp_path, "actor/0/0", "actor/0/1", "actor/0/2")
    procs.get("actor/0/0").handle.code, procs.get("actor/0/0").error = 1, GLOO_RESET
    procs.get("actor/0/2").handle.code, procs.get("actor/0/2").error = 1, GLOO_RESET
    procs.get("actor/0/1").handle.code = -9
    assert [p.id for p, _ in r.down()] == ["actor/0/1", "actor/0/0", "actor/0/2"]


def test_a_process_found_silent_takes_the_processes_of_its_host_due_within_a_heartbeat_down_with_it(tmp_path):
    """A host that vanished without a word (before Ray notices): its processes stop beating together
    and would be found at their deadlines a tick or two apart, each a recovery epoch. The first found
    brings down those of its host within one heartbeat of their deadline; not a process of its host
    that beats, nor a silent one of another host."""
    r, procs, *_ = restarts(tmp_path, "actor/0/0", "critic/0/0", "reward/0/0", "rollout/0/0")
    actor, critic, reward, rollout = (procs.get(x) for x in ("actor/0/0", "critic/0/0", "reward/0/0", "rollout/0/0"))
    for p in (actor, critic, reward):
        p.spec.host = "b"
    rollout.spec.host = "a"
    t = time.monotonic()
    deadline, beat = r.supervisor.sup.deadline_s, r.supervisor.sup.heartbeat_s
    actor.last_seen = t - deadline - 0.1
    critic.last_seen = t - deadline + beat / 2  # due in half a heartbeat
    reward.last_seen = t - beat  # beating
    rollout.last_seen = t - deadline + beat / 2  # as silent, but another host
    down = r.down(now=t)
    assert [p.id for p, _ in down] == ["actor/0/0", "critic/0/0"]
    assert down[1][1] == f"missed heartbeats for {deadline - beat / 2:.1f} s, like actor/0/0 on its host: hung"
    # on the controller's own machine, processes silent together more likely mean the controller
    # (or the machine) stalled: each is judged by its own deadline
    r, procs, *_ = restarts(tmp_path, "actor/0/0", "critic/0/0")
    procs.get("actor/0/0").last_seen = t - deadline - 0.1
    procs.get("critic/0/0").last_seen = t - deadline + beat / 2
    assert [p.id for p, _ in r.down(now=t)] == ["actor/0/0"]
