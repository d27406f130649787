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
the consumers drop. Weight sync forms a new epoch without it at once (`follow_members`), so the
trainer never waits for a replica that is going. A removed process that was (re)starting gets its
Stop when it reports READY; one that has not stopped after `retire_grace_s` is stopped by PID
(SIGTERM, then SIGKILL). A replica added again while its removed predecessor still stops takes
over its id as a later incarnation (the predecessor is killed). Each change is a `scaled` row in
the ledger.

The client speaks the control plane: `RUN_DIR/control.json` (readable by the run's user only)
holds the controller's address and the run's secret. The controller's side is `ScaleClient`
(mixed into `Controller`): it answers requests on the control socket and forgets removed
processes once they are gone.
"""

from __future__ import annotations

import hmac
import json
import logging
import signal
import time
from pathlib import Path

from flowrl.errors import FlowrlError
from flowrl.runtime.protocol import messages as m

log = logging.getLogger("flowrl.controller")


class ScaleError(FlowrlError):
    """The scale request was refused (the message says why) or got no answer."""


async def scale(controller, node: str, replicas: int) -> str:
    """Run `replicas` replicas of `node`; returns what changed. Raises ScaleError."""
    from flowrl.placement import get_inventory, make_plan
    from flowrl.runtime.controller.procs import Proc

    c = controller
    spec = c.spec
    if node not in spec.nodes:
        raise ScaleError(f"no node {node!r}; nodes are {', '.join(spec.nodes)}")
    if node in c.stateful:
        raise ScaleError(f"node {node!r} is stateful: its replicas would each train their own state; "
                         "scale stateless nodes (rollout, reward, reference), or use devices: N")
    if not 1 <= replicas <= 256:
        raise ScaleError(f"replicas must be between 1 and 256, got {replicas}")
    if c.net.multi_host:
        raise ScaleError("this run spans several hosts; scaling it while it runs is not supported yet (new replicas "
                         "would need CURVE keys its consumers and control admit): set replicas in the graph and resume")
    if c.recovering is not None:
        raise ScaleError("the run is recovering from a failure; try again in a moment")
    old = spec.nodes[node].replicas
    if replicas == old:
        return f"{node} already has {old} replica(s)"
    if replicas > old:
        wanted = spec.model_copy(deep=True)
        wanted.nodes[node].replicas = replicas
        plan = make_plan(wanted, get_inventory(c.inventory))
        errors = [f for f in plan.errors if f.node == node]
        if errors:
            raise ScaleError("; ".join(f"{f.code}: {f.message}" for f in errors))
        entries = [e for e in plan.entries if e.node == node and e.replica >= old]
        spec.nodes[node].replicas = replicas
        from flowrl.runtime.controller.wiring import free_port

        ports: dict[int, int] = {}
        for entry in entries:
            c.plan.entries.append(entry)
            proc = Proc(spec=c.proc_spec(entry, ports.setdefault(entry.replica, free_port())))
            gone = c.procs.procs.get(proc.id)
            if gone is not None:  # removed a moment ago and still stopping: it goes now, and nothing it
                c.displace_retired(gone)  # still says is taken for the new one's (a later incarnation)
                proc.spec.incarnation = proc.first_incarnation = gone.spec.incarnation + 1
            c.prepare_start(proc)
            c.procs.add(proc)
            c.supervisor.launch(proc)
        for r in range(old, replicas):
            await _rewire(c, node, r, add=True)
    else:
        spec.nodes[node].replicas = replicas
        c.plan.entries = [e for e in c.plan.entries if not (e.node == node and e.replica >= replicas)]
        for r in range(old - 1, replicas - 1, -1):
            await _rewire(c, node, r, add=False)
            for proc in [p for p in c.procs.of_node(node) if p.spec.replica == r]:
                proc.retired, proc.retired_at = True, time.monotonic()
                await c.send(proc, m.Stop())  # not there (restarting)? it gets Stop at its READY
        c.retire_stopped()
        await c.follow_members()  # weight sync goes on without them at once, not when they are gone
    if c.summary is not None:
        c.summary.setdefault("nodes", {})[node] = replicas
    c.ledger.write("scaled", "-", 0, node=node, replicas=replicas, was=old)
    if c.hub:
        c.hub.event("scale", node=node, replicas=replicas, was=old)
    return f"{node}: {old} -> {replicas} replica(s)"


async def _rewire(c, node: str, replica: int, *, add: bool) -> None:
    """Tell every producer of `node` (and the specs they restart with) about one replica."""
    for e in c.spec.edges:
        if e.dst != node:
            continue
        address = c.address(node, replica, e.dst_port)
        for proc in c.procs.of_node(e.src):
            for route in proc.spec.outputs:
                if route.edge != str(e):
                    continue
                if add and address not in route.addresses:
                    route.addresses.append(address)
                elif not add and address in route.addresses:
                    route.addresses.remove(address)
            if proc.wired:
                msg = m.Connect if add else m.Disconnect
                await c.send(proc, msg(edge=str(e), address=address))


class ScaleClient:
    """The controller's scaling half: `flowrl scale` requests and the retirement of removed processes."""

    async def on_client(self, identity: bytes, data: bytes) -> None:
        """A request from `flowrl scale` (or `flowrl.scale`): answered on the same socket."""
        import zmq

        try:
            msg = m.decode(data)
        except m.ControlError:
            self.rejected += 1
            return
        if not isinstance(msg, m.Scale) or not hmac.compare_digest(msg.k or "", self.secret):
            self.rejected += 1
            return
        try:
            reply = m.Scaled(ok=True, message=await scale(self, msg.node, msg.replicas))
        except ScaleError as e:
            reply = m.Scaled(ok=False, message=str(e))
        try:
            await self.router.send_multipart([identity, m.encode(reply)])
        except zmq.ZMQError:
            pass

    def retire_grace_s(self) -> float:
        """How long a removed process may take to stop on its own: a weight-sync collective it was
        in ends within its timeout, then it takes its Stop. Its producers handed whatever it had not
        acknowledged to the other replicas, so stopping it later loses nothing."""
        return self.sync_timeout_s() + self.spec.supervision.stop_timeout_s

    def retire_stopped(self) -> None:
        """Forget processes removed by `flowrl scale` once they are gone; one that outstays its
        grace gets SIGTERM, and SIGKILL stop_timeout_s later (by PID)."""
        now = time.monotonic()
        for proc in [p for p in self.procs if p.retired] + list(self.retiring):
            if proc.handle is not None and proc.alive:
                late = now - (proc.retired_at or now) - self.retire_grace_s()
                if late > self.spec.supervision.stop_timeout_s:
                    proc.handle.signal(signal.SIGKILL)
                elif late > 0 and not proc.terminated:
                    log.warning("%s was removed %.0f s ago and has not stopped: SIGTERM", proc.id, now - proc.retired_at)
                    proc.handle.signal(signal.SIGTERM)
                    proc.terminated = True
                continue
            self.sync_members = [p for p in self.sync_members if p is not proc]
            if proc in self.retiring:
                self.retiring.remove(proc)
                continue
            del self.procs.procs[proc.id]
            if self.hub:
                self.hub.forget(proc.spec.node, proc.spec.replica)

    def displace_retired(self, proc) -> None:
        """A new replica takes the id of `proc`, removed but not gone yet: SIGKILL it (its producers
        handed its unacknowledged work to the others) and reap it apart from the table."""
        if proc.handle is not None and proc.alive:
            proc.handle.signal(signal.SIGKILL)
            self.retiring.append(proc)
        self.sync_members = [p for p in self.sync_members if p is not proc]
        del self.procs.procs[proc.id]


def write_control_file(run_dir: Path, address: str, secret: str) -> None:
    path = Path(run_dir) / "control.json"
    path.write_text(json.dumps({"address": address, "secret": secret, "pid": __import__("os").getpid()}))
    path.chmod(0o600)


def request(run_dir: str | Path, node: str, replicas: int, timeout_s: float = 30.0) -> str:
    """Ask the controller of a running run to scale `node`; returns its answer or raises ScaleError."""
    import secrets

    import zmq

    path = Path(run_dir) / "control.json"
    try:
        info = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        raise ScaleError(f"{path} is missing or unreadable: is the run still going?") from None
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"client#{secrets.token_hex(4)}".encode())
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(info["address"])
        sock.send(m.encode(m.Scale(node=node, replicas=replicas), info["secret"]))
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
