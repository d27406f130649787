"""Elastic replicas: `flowrl scale RUN_DIR rollout=3` while the run goes on.

    flowrl scale runs/grpo-1 rollout=3          # add two rollout replicas
    flowrl.scale("runs/grpo-1", "rollout", 1)   # back to one, from Python

Only stateless nodes scale (a replica of a stateful node would fork its state). Adding a replica:
the planner places it on the inventory as if the graph had said `replicas: N` (or the command
fails with the plan's finding), it starts from the fork server, reports READY, is wired, joins the
next weight-sync epoch (subscribers get the current weights before any batch: the version gate),
and its producers connect to it — from then on it takes work like the others. Removing one: its
producers disconnect first and send whatever it had not acknowledged to the other replicas, then
it is stopped; nothing it held is lost, and a batch it was finishing is at worst a duplicate that
the consumers drop. Weight sync forms a new epoch without it at once (`SyncGroup.follow`), so the
trainer never waits for a replica that is going. A removed process that was (re)starting gets its
Stop when it reports READY; one that has not stopped after `retire_grace_s` is stopped by PID
(SIGTERM, then SIGKILL). A replica added again while its removed predecessor still stops takes
over its id as a later incarnation (the predecessor is killed). Each change is a `scaled` row in
the ledger, and RUN_DIR/plan.json is rewritten with it (a `plan` row, planfile.py). On a run that
spans hosts, a new replica goes where the live cluster has room and its CURVE key is admitted by
the control and the consumers it feeds before it starts, revoked when it is removed (crosshost.py).

The client speaks the control plane: `RUN_DIR/control.json` (a `ControlFile`, control.py,
readable by the run's user only) holds the controller's address and the run's secret. The
controller answers a request with `scale(...)`, given the components it changes; `Retirement`
is the one writer of the removed processes still stopping, and forgets them once they are gone.
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from typing import Awaitable, Callable

from flowrl.errors import FlowrlError
from flowrl.runtime.controller.control import ControlFile, ControlFileError
from flowrl.runtime.controller.crosshost import admit, place_replicas
from flowrl.runtime.controller.procs import Proc, ProcTable, Removal
from flowrl.runtime.controller.report import RunReport
from flowrl.runtime.controller.roles import Roles
from flowrl.runtime.controller.weightorders import SyncGroup
from flowrl.runtime.controller.wiring import Wiring, free_port
from flowrl.runtime.protocol import messages as m
from flowrl.runtime.protocol.addresses import SERVE_PORT
from flowrl.runtime.protocol.ledger import NodeScaled

log = logging.getLogger("flowrl.controller")

MAX_REPLICAS = 256  # most replicas `flowrl scale` runs of one node

Send = Callable[[Proc, object], Awaitable[bool]]


class ScaleError(FlowrlError):
    """The scale request was refused (the message says why) or got no answer."""


class Retirement:
    """Processes `flowrl scale` removed: stopping, then forgotten (one that outstays its grace is
    stopped by PID); and removed ones displaced by a new replica that takes their id."""

    def __init__(self, procs: ProcTable, sync: SyncGroup, report: RunReport, *, stop_timeout_s: float):
        self.procs = procs
        self.sync = sync
        self.report = report
        self.stop_timeout_s = stop_timeout_s
        self.retiring: list[Proc] = []  # removed replicas still stopping whose id a new replica took

    def grace_s(self) -> float:
        """How long a removed process may take to stop on its own: a weight-sync collective it was
        in ends within its timeout, then it takes its Stop. Its producers handed whatever it had not
        acknowledged to the other replicas, so stopping it later loses nothing."""
        return self.sync.timeout_s() + self.stop_timeout_s

    async def retire(self, proc: Proc, send: Send) -> None:
        proc.removed = Removal(at=time.monotonic())
        await send(proc, m.Stop())  # not there (restarting)? it gets Stop at its READY

    def reap(self, now: float | None = None) -> None:
        """Forget removed processes once they are gone; one that outstays its grace gets SIGTERM,
        and SIGKILL stop_timeout_s later (by PID)."""
        now = time.monotonic() if now is None else now
        for proc in [p for p in self.procs if p.retired] + list(self.retiring):
            removal = proc.removed or Removal()  # a displaced one was removed before
            if proc.handle is not None and proc.alive:
                late = now - (removal.at or now) - self.grace_s()
                if late > self.stop_timeout_s:
                    proc.handle.signal(signal.SIGKILL)
                elif late > 0 and not removal.terminated:
                    log.warning("%s was removed %.0f s ago and has not stopped: SIGTERM", proc.id, now - removal.at)
                    proc.handle.signal(signal.SIGTERM)
                    removal.terminated = True
                continue
            self.sync.drop(proc)
            if proc in self.retiring:
                self.retiring.remove(proc)
                continue
            self.procs.remove(proc)
            self.report.forget(proc)

    def displace(self, proc: Proc) -> None:
        """A new replica takes the id of `proc`, removed but not gone yet: SIGKILL it (its producers
        handed its unacknowledged work to the others) and reap it apart from the table."""
        if proc.handle is not None and proc.alive:
            proc.handle.signal(signal.SIGKILL)
            self.retiring.append(proc)
        self.sync.drop(proc)
        self.procs.remove(proc)


async def scale(node: str, replicas: int, *, spec, roles: Roles, procs: ProcTable, wiring: Wiring,
                launch: Callable[[Proc], None], send: Send, sync: SyncGroup, retirement: Retirement,
                report: RunReport, ledger, recovering: bool, version: int, planfile=None) -> str:
    """Run `replicas` replicas of `node`; returns what changed. Raises ScaleError.

    spec: the graph as it runs (its replica count changes); wiring: plans, specs and addresses of
    the new replicas; launch: starts one; sync: the weight-sync group (a new epoch without removed
    ones); recovering: whether a recovery runs (refused then); version: the trainer's newest;
    planfile: RUN_DIR/plan.json, rewritten with the change (planfile.py)."""
    if node not in spec.nodes:
        raise ScaleError(f"no node {node!r}; nodes are {', '.join(spec.nodes)}")
    if node in roles.stateful:
        raise ScaleError(f"node {node!r} is stateful: its replicas would each train their own state; "
                         "scale stateless nodes (rollout, reward, reference), or use devices: N")
    if not 1 <= replicas <= MAX_REPLICAS:
        raise ScaleError(f"replicas must be between 1 and {MAX_REPLICAS}, got {replicas}")
    if recovering:
        raise ScaleError("the run is recovering from a failure; try again in a moment")
    old = spec.nodes[node].replicas
    if replicas == old:
        return f"{node} already has {old} replica(s)"
    multi = wiring.multi_host  # across hosts: free devices on the live cluster, keys admitted (crosshost.py)
    if replicas > old:
        if multi:
            entries, why = place_replicas(wiring, node, replicas)
            if why:
                raise ScaleError(why)
        else:
            entries, errors = wiring.plan_replicas(node, replicas)
            if errors:
                raise ScaleError("; ".join(f"{f.code}: {f.message}" for f in errors))
        spec.nodes[node].replicas = replicas
        for entry in entries:
            wiring.add_entry(entry)
        _plan_changed(planfile, node, old, replicas, added={f"{e.node}/{e.replica}/{e.rank}": e.host for e in entries})
        ports: dict[int, int] = {}
        for entry in entries:  # plan.json says where each goes before it starts (the Ray launcher reads it)
            proc = Proc(spec=wiring.proc_spec(entry, ports.setdefault(entry.replica, free_port())))
            gone = procs.get(proc.id)
            if gone is not None:  # removed a moment ago and still stopping: it goes now, and nothing it
                retirement.displace(gone)  # still says is taken for the new one's (a later incarnation)
                proc.spec.incarnation = proc.first_incarnation = gone.spec.incarnation + 1
            wiring.prepare_start(proc)
            procs.add(proc)
            await admit(wiring, procs, send, proc.id)  # its key, before it can connect anywhere
            launch(proc)
        for r in range(old, replicas):
            await _rewire(spec, wiring, procs, send, node, r, add=True)
    else:
        spec.nodes[node].replicas = replicas
        removed = [f"{e.node}/{e.replica}/{e.rank}" for e in wiring.plan.entries if e.node == node and e.replica >= replicas]
        wiring.drop_entries(node, replicas)
        _plan_changed(planfile, node, old, replicas, removed=removed)
        for r in range(old - 1, replicas - 1, -1):
            await _rewire(spec, wiring, procs, send, node, r, add=False)
            for proc in [p for p in procs.of_node(node) if p.spec.replica == r]:
                await retirement.retire(proc, send)
                await admit(wiring, procs, send, proc.id, add=False)  # its key is refused from now on
                wiring.net.forget(proc.id)
        retirement.reap()
        await sync.follow(version, recovering=False)  # weight sync goes on without them at once
    ledger.record(NodeScaled(node=node, replicas=replicas, was=old))
    report.scaled(node, replicas, old)
    return f"{node}: {old} -> {replicas} replica(s)"


def _plan_changed(planfile, node: str, old: int, replicas: int, **change) -> None:
    if planfile is not None:
        planfile.changed(f"scale {node} {old} -> {replicas}", **change)


async def _rewire(spec, wiring: Wiring, procs: ProcTable, send: Send, node: str, replica: int, *, add: bool) -> None:
    """Tell every producer of `node` (and the specs they restart with) about one replica."""
    for e in spec.edges:
        if e.dst != node:
            continue
        address = wiring.address(node, replica, e.dst_port)
        if add and not wiring.known(node, replica, e.dst_port):  # a tcp port it has yet to bind: its producers
            continue  # connect once it reports READY with it (Wiring.on_bound)
        for proc in procs.of_node(e.src):
            for route in proc.spec.outputs:
                if route.edge != str(e):
                    continue
                if add and address not in route.addresses:
                    route.addresses.append(address)
                elif not add and address in route.addresses:
                    route.addresses.remove(address)
            if proc.wired:
                key = {"key": wiring.net.server_key(node, replica, address) or None} if add else {}
                await send(proc, (m.Connect if add else m.Disconnect)(edge=str(e), address=address, **key))
    for svc in [s for s in spec.services if s.dst == node]:  # clients of a scaled server
        address = wiring.address(node, replica, SERVE_PORT)
        if add and not wiring.known(node, replica, SERVE_PORT):
            continue
        for proc in procs.of_node(svc.src):
            if proc.wired:
                msg = m.Connect if add else m.Disconnect
                await send(proc, msg(edge=svc.name, address=address, **({"key": wiring.net.server_key(node, replica, address) or None} if add else {})))


def request(run_dir: str | Path, node: str, replicas: int, timeout_s: float = 30.0) -> str:
    """Ask the controller of a running run to scale `node`; returns its answer or raises ScaleError."""
    import secrets

    import zmq

    try:
        control = ControlFile.read(run_dir)
    except ControlFileError as e:
        raise ScaleError(str(e)) from None
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"client#{secrets.token_hex(4)}".encode())
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(control.address)
        sock.send(m.encode(m.Scale(node=node, replicas=replicas), control.secret))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sock.poll(200):
                reply = m.decode(sock.recv())
                if isinstance(reply, m.Scaled):
                    if not reply.ok:
                        raise ScaleError(reply.message)
                    return reply.message
        raise ScaleError(f"the controller did not answer within {timeout_s:.0f} s")
    finally:
        sock.close()
        ctx.term()
