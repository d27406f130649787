"""Restarts: what happens to a process that went down, and to its rank group.

The supervisor decides whether a process that went down is restarted (`Supervisor.on_down`);
`Restarts` carries the decision out. A dead rank takes its whole rank group down with it (a fresh
torch.distributed group on a new MASTER_PORT); a process of a lost host is re-planned first
(`replan.py`, given as `replan`). Whether the process held state (a recovery epoch then, see
recovery.py) is the controller's to act on: `on_down` only says whether the process restarts.

    restarts = Restarts(supervisor, launcher, procs, wiring=wiring, report=report, ledger=ledger,
                        fail=outcome.fail, replan=lambda host: move_off(host, ...))
    for proc, why in restarts.down():      # each tick
        if restarts.on_down(proc, why): ...  # restarting (after its backoff): recover or follow
    for proc in restarts.due(): restarts.restart(proc)
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from flowrl.runtime.controller.procs import Proc, ProcTable
from flowrl.runtime.controller.report import RunReport
from flowrl.runtime.controller.supervisor import MISSED_HEARTBEATS, Supervisor, last_words
from flowrl.runtime.controller.wiring import Wiring
from flowrl.runtime.controller.shards import ensure_shard
from flowrl.runtime.protocol.checkpoints import CheckpointError
from flowrl.runtime.protocol.ledger import NodeDown

log = logging.getLogger("flowrl.controller")


PEER_LOSS_GRACE_S = 1.0
"""How long a rank that failed because a peer of its collective went away waits for that peer's exit to
be seen (`Restarts.down`). The peer exits first, yet its exit can be seen a check later (a rank on
another host), and the first one seen down is the one its group's restart names."""
SILENT_BEATS = 3
"""A rank that lost a peer, once its grace is over, names as the cause a mate that has sent no
heartbeat for this many heartbeat intervals (at least the grace; `Restarts.down`): a rank dead and
not seen yet, or hung while its partners' collectives gave up before its deadline, would otherwise
be seen after the survivor, which would be named for what it did."""
DIED, EXITED, LOST_A_PEER = 0, 1, 2


def blame(proc: Proc, why: str) -> int:
    """How likely `proc` going down (`why`) caused its rank group's failure: DIED (killed by a
    signal, hung, or never ready) before EXITED (on its own, its error not a collective's) before
    LOST_A_PEER (its error says a peer of its collective went away)."""
    code = proc.handle.poll() if proc.handle is not None else None
    if why not in ("exited", "failed in setup") or code is None or code < 0:
        return DIED
    return LOST_A_PEER if proc.error is not None and lost_a_peer(proc.error.type, proc.error.message) else EXITED


def lost_a_peer(error_type: str, message: str) -> bool:
    """Whether an error is a collective's that lost a peer (gloo's transport, NCCL, torch.distributed's
    own error types), not one of the node's own."""
    return error_type in ("DistBackendError", "DistNetworkError", "DistStoreError") or "gloo/transport" in message \
        or "NCCL error" in message or "Connection reset by peer" in message or "Connection closed by peer" in message


class Restarts:
    def __init__(self, supervisor: Supervisor, launcher, procs: ProcTable, *, wiring: Wiring, report: RunReport,
                 ledger, fail: Callable[[Proc | None, str], None], replan: Callable[[str], str | None],
                 stop_grace_s: float = 0.5):
        self.supervisor = supervisor
        self.launcher = launcher
        self.procs = procs
        self.wiring = wiring
        self.report = report
        self.ledger = ledger
        self.fail = fail
        self.replan = replan  # a lost host's processes move: None, or why the run must fail
        self.stop_grace_s = stop_grace_s  # a surviving rank of a broken group: SIGTERM, then SIGKILL after this
        self._waiting: dict[str, float] = {}  # proc id -> since when a rank that lost a peer waits (`down`)
        self._lost: dict = {}  # host -> whether it left the cluster, this tick (`host_lost`)

    def launch(self, proc: Proc) -> None:
        try:  # a stateful process starting where its checkpoint shard is not gets it first (shards.py)
            if proc.spec.resume_from:
                ensure_shard(self.wiring.book, proc.spec, self.launcher, self.wiring.spec.launcher.host_dirs,
                             self.ledger)
        except CheckpointError as e:
            self.fail(None, str(e))
            return
        self.supervisor.launch(proc)
        self.report.node_up(proc, False)

    def down(self, now: float | None = None) -> list[tuple[Proc, str]]:
        """Processes that went down since the last tick (removed replicas are not watched; with them
        the rest of a lost host, `host_mates`), the likely cause of a rank group's failure first
        (`blame`): the rank that died, not the ranks whose collective broke because it did. A rank of
        the second kind whose group has no other cause in sight waits up to PEER_LOSS_GRACE_S for it
        to be seen; then a mate silent for SILENT_BEATS heartbeats is named, first, and goes down."""
        now = time.monotonic() if now is None else now
        self._lost = {}
        found = self.supervisor.check([p for p in self.procs if not p.retired], now)
        found += self.host_mates(found, now)
        seen = {p.id for p, _ in found}
        ranks = {p.id: blame(p, why) for p, why in found}
        causes = {pid for pid, rank in ranks.items() if rank != LOST_A_PEER}
        out, waiting = [], {}
        silent_s = max(SILENT_BEATS * self.supervisor.sup.heartbeat_s, PEER_LOSS_GRACE_S)
        for proc, why in found:
            rank = ranks[proc.id]
            mates = [p for p in self.rank_group(proc) if p is not proc] if rank == LOST_A_PEER else []
            if mates and not any(p.id in causes or p.down_since is not None for p in mates):
                waiting[proc.id] = since = self._waiting.get(proc.id, now)
                if now - since < PEER_LOSS_GRACE_S:
                    continue
                silent = [p for p in mates if p.id not in seen and p.ready and p.handle is not None
                          and now - p.last_seen > silent_s]
                if silent:  # the peer it lost is there but says nothing (hung, or dead and not seen yet)
                    mate = min(silent, key=lambda p: p.last_seen)
                    seen.add(mate.id)
                    causes.add(mate.id)
                    out.append((DIED, mate, f"sent no heartbeat for {now - mate.last_seen:.1f} s while its rank "
                                            f"group's collective waited for it ({proc.id} gave up on it)"))
            out.append((rank, proc, why))
        self._waiting = waiting
        out.sort(key=lambda d: d[0])  # stable among equals: the order they were found in
        return [(proc, why) for _, proc, why in out]

    def host_mates(self, found: list[tuple[Proc, str]], now: float) -> list[tuple[Proc, str]]:
        """The other processes of a host one of whose processes was found down, when they are down
        too: all of them when the host left the cluster (the launcher says so: Ray no longer lists
        it), and those about to miss their heartbeat deadline (within one heartbeat of it) when the
        process was found silent on another machine than the controller's (a host that vanished
        without a word, before Ray notices). Seen one by one instead, each stateful one would open a
        recovery epoch of its own and roll every stateful node back again."""
        hosts = {p.spec.host for p, _ in found}
        if not hosts:
            return []
        lost = {h for h in hosts if self.host_lost(h)}
        sup = self.supervisor.sup
        silent = {p.spec.host: p.id for p, why in found
                  if why.startswith(MISSED_HEARTBEATS) and self.launcher.is_remote(p.spec.host)}
        near = sup.deadline_s - sup.heartbeat_s
        out = []
        seen = {p.id for p, _ in found}
        for p in self.procs:
            if p.spec.host not in hosts or p.id in seen or p.retired or p.handle is None \
                    or p.down_since is not None or p.restart.at is not None:
                continue
            if p.spec.host in lost:
                out.append((p, f"its host {p.spec.host} left the cluster"))
            elif p.spec.host in silent and p.ready and now - p.last_seen > near:
                out.append((p, f"{MISSED_HEARTBEATS} for {now - p.last_seen:.1f} s, like {silent[p.spec.host]} on "
                               f"its host: hung"))
        return out

    def host_lost(self, host: str | None) -> bool:
        """Whether `host` left the cluster: the launcher's word, asked once a tick (Ray: a call to its
        control service), False if it cannot say now."""
        if host not in self._lost:
            try:
                self._lost[host] = self.launcher.is_lost(host)
            except Exception as e:  # noqa: BLE001 - a cluster that does not answer now is asked again next tick
                log.warning("cannot tell whether host %s is still in the cluster: %s", host, e)
                return False
        return self._lost[host]

    def due(self) -> list[Proc]:
        """Processes whose restart backoff has passed."""
        return self.supervisor.due(self.procs)

    def on_down(self, proc: Proc, why: str) -> bool:
        """Apply `proc`'s failure policy: True when it restarts (with its rank group); False when
        the run failed."""
        self.report.node_up(proc, False)
        verdict = self.supervisor.on_down(proc, why, gone=self.host_lost(proc.spec.host))
        self.ledger.record(NodeDown(attempt=proc.spec.incarnation, node=proc.id, why=why))
        if verdict != "restart":
            self.fail(proc, verdict)
            return False
        self.report.restarted(proc, why)
        self.restart_rank_group(proc)
        return True

    def rank_group(self, proc: Proc) -> list[Proc]:
        return [p for p in self.procs.of_node(proc.spec.node) if p.spec.replica == proc.spec.replica]

    def restart_rank_group(self, proc: Proc) -> None:
        """A dead rank takes its whole group down: the survivors are stopped and every rank starts
        again together, in a fresh torch.distributed group (a new MASTER_PORT)."""
        group = self.rank_group(proc)
        if len(group) < 2:
            return
        port = str(self.launcher.free_port(group[0].spec.env.get("MASTER_ADDR") or "127.0.0.1"))
        # ranks still starting when the group goes down may be why it did (one hung in setup while
        # its leader waited for it): their stacks go to their logs first
        last_words([p for p in group if p is not proc and p.down_since is None and not p.ready])
        for p in group:
            p.spec.env["MASTER_PORT"] = port
            if p is proc:
                continue
            if p.down_since is None and p.handle is not None:
                if self.host_lost(p.spec.host):
                    p.handle.release()  # nothing there to stop or wait for
                else:
                    p.handle.stop(self.stop_grace_s)
                p.ready = p.wired = False
                p.down_since = time.monotonic()
                self.ledger.record(NodeDown(attempt=p.spec.incarnation, node=p.id, why=f"its rank group lost {proc.id}"))
            p.restart.at = proc.restart.at

    def restart(self, proc: Proc) -> None:
        """Start `proc`'s next incarnation (moved off its host first when that host is lost)."""
        for host in sorted({p.spec.host for p in self.rank_group(proc) or [proc]}, key=str):
            if self.launcher.is_lost(host):  # a rank there: the replica's group moves as one
                why = self.replan(host)
                if why:
                    self.fail(proc, why)
                    return
        proc.spec.incarnation += 1
        self.wiring.prepare_start(proc)
        self.launch(proc)
