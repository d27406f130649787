"""Setting node processes up: what each one is told and where it starts.

It owns the controller's side of the data plane's addresses: the `ProcSpec` each process reads
before it starts (its inputs, outputs, ranks, keys, devices), where a (re)started process begins
(the current recovery epoch, the committed checkpoint, `--resume`), the addresses consumers
report they bound and the routes producers are wired with (`Wire` once every process is READY;
`Connect`/`Disconnect` when a consumer moved). Also the run's private socket folder and the free
ports of the torch.distributed groups.

`Wiring` is the one writer of the bound addresses, the plan's entries (`flowrl scale` adds and
removes replicas through it) and whether the first `Wire` went out. Where a process starts comes
from the recovery book (epoch, committed checkpoint) and the scheduler (end, consumption), asked.

    wiring = Wiring(spec, plan, classes, roles, net, facts, launcher=launcher, procs=procs, send=send,
                    book=book, scheduler=scheduler)
    wiring.build_procs()                  # one Proc per plan entry, specs written at launch
    wiring.prepare_start(proc)            # before each (re)start
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

from flowrl.runtime.protocol import messages as m
from flowrl.runtime.controller.procs import Proc, ProcTable
from flowrl.runtime.controller.planfile import PlanFile
from flowrl.runtime.controller.recovery import RecoveryBook
from flowrl.runtime.controller.roles import Roles
from flowrl.runtime.controller.scheduler import Scheduler
from flowrl.runtime.controller.turns import TurnBook, Turns, colocation_groups, refuse_multi_rank, turn_groups
from flowrl.runtime.protocol.procspec import OutputRoute, ProcSpec
from flowrl.runtime.protocol.addresses import SERVE_PORT, free_port  # noqa: F401 - used by restarts, scaling
from flowrl.runtime.protocol.checkpoints import host_folder


@dataclass(frozen=True)
class RunFacts:
    """What every process of the run is told alike."""

    run_dir: Path
    secret: str  # the run's control-plane secret
    faults: tuple[str, ...] = ()
    inventory: str | None = None  # where `flowrl scale` plans new replicas (None: this machine)


class Wiring:
    def __init__(self, spec, plan, classes: dict, roles: Roles, net, facts: RunFacts, *, launcher, procs: ProcTable,
                 send: Callable[[Proc, object], Awaitable[bool]], book: RecoveryBook, scheduler: Scheduler, ledger=None):
        self.spec, self.classes, self.roles = spec, classes, roles
        self.planfile = PlanFile(facts.run_dir, plan, ledger)  # the plan's entries, and plan.json when they change
        self.net = net
        self.facts = facts
        self.launcher = launcher
        self.procs = procs
        self.send = send
        self.book = book
        self.scheduler = scheduler
        # (node, replica, port) -> the address that consumer bound; None: a tcp input of a replica
        # `flowrl scale` added, not bound yet (its producers are told at its READY)
        self.bound: dict[tuple, str | None] = {}
        self.started = False  # every process got its first Wire
        groups = turn_groups(spec)  # colocated nodes that take turns on their devices (turns.py)
        refuse_multi_rank(spec, groups)
        self.turns = Turns(TurnBook(groups), procs, send)  # who holds each group's turn
        self.colocation = colocation_groups(spec)  # a weight sync among one group's members is a handoff

    @property
    def plan(self):
        return self.planfile.plan

    @property
    def multi_host(self) -> bool:
        return self.net.multi_host

    def address(self, node: str, replica: int, port: str) -> str:
        return self.bound.get((node, replica, port)) or self.net.input_address(node, replica, port)

    def known(self, node: str, replica: int, port: str) -> bool:
        """Whether producers can be told this input's address now: ipc, or a tcp port it bound; else
        its producers are told when it reports READY with it (`on_bound`)."""
        key = (node, replica, port)
        if self.bound.get(key) or not self.address(node, replica, port).startswith("tcp://"):
            return True
        self.bound[key] = None
        return False

    def routes_for(self, proc: Proc) -> dict:
        """edge -> [[address, CURVE key], ...] of each consumer replica, as bound now (for Wire)."""
        out = {}
        for route in proc.spec.outputs:
            e = next(e for e in self.spec.edges if str(e) == route.edge)
            out[route.edge] = [[a, self.net.server_key(e.dst, r, a)] for r in range(self.spec.nodes[e.dst].replicas)
                               for a in [self.address(e.dst, r, e.dst_port)] if not a.endswith(":0")]
        for server in proc.spec.services:  # `services: [this node -> server]`: every replica of the server
            out[f"service:{server}"] = [[a, self.net.server_key(server, r, a)] for r in range(self.spec.nodes[server].replicas)
                                        for a in [self.address(server, r, SERVE_PORT)]]
        return out

    async def on_bound(self, proc: Proc, inputs: dict | None) -> None:
        """A consumer reported the addresses it bound: a restart binds them again; a consumer that
        moved (re-plan) or got another port is reached there by every wired producer."""
        ps = proc.spec
        for port, address in (inputs or {}).items():
            if port not in ps.inputs or not isinstance(address, str):
                continue
            key = (ps.node, ps.replica, port)
            awaited, old = key in self.bound and self.bound[key] is None, self.bound.get(key)
            self.bound[key] = ps.inputs[port] = address
            if (old is None and not awaited) or old == address:  # awaited: a replica `flowrl scale` added
                continue
            routes = [(str(e), e.src) for e in self.spec.edges if e.dst == ps.node and e.dst_port == port]
            if port == SERVE_PORT:
                routes = [(s.name, s.src) for s in self.spec.services if s.dst == ps.node]
            for edge, src in routes:
                for p in self.procs.of_node(src):
                    for route in p.spec.outputs if old is None else ():  # its restarts send there too
                        if route.edge == edge and address not in route.addresses:
                            route.addresses.append(address)
                    if p.ready and p.down_since is None:  # it got Wire already (or gets these routes in it)
                        await self.send(p, m.Connect(edge=edge, address=address,
                                                     key=self.net.server_key(ps.node, ps.replica, address) or None))
                        if old is not None:
                            await self.send(p, m.Disconnect(edge=edge, address=old))

    def build_procs(self) -> None:
        master_ports: dict[tuple, int] = {}
        for entry in self.plan.entries:
            group = (entry.node, entry.replica)
            if group not in master_ports:
                master_ports[group] = self.launcher.free_port(self.net.where.get(f"{entry.node}/{entry.replica}/0")
                                                              or entry.master_addr)
            self.procs.add(Proc(spec=self.proc_spec(entry, master_ports[group])))

    def rank_links(self, node: str, replica: int, world_size: int) -> tuple[list[str], list[str]]:
        """Each rank's shard channel address and key (addresses.py `Network.rank_links`)."""
        return self.net.rank_links(node, replica, world_size, self.launcher.free_port)

    def relink_ranks(self, group: list[Proc]) -> None:
        """A replica's ranks after some moved host: every rank's shard addresses and keys again."""
        if not group:
            return
        ps0 = group[0].spec
        addresses, keys = self.rank_links(ps0.node, ps0.replica, ps0.world_size)
        for p in group:
            p.spec.rank_addresses, p.spec.rank_keys = addresses, keys
            p.spec.rank_clients = self.net.rank_clients(p.spec.node, p.spec.replica, p.spec.rank)

    # the plan as `flowrl scale` changes it ----------------------------------------------------
    def plan_replicas(self, node: str, replicas: int):
        """Entries of replicas of `node` beyond today's, placed as if the graph said `replicas`, and
        the plan's findings about `node` (nothing is added yet)."""
        from flowrl.placement import get_inventory, make_plan

        wanted = self.spec.model_copy(deep=True)
        wanted.nodes[node].replicas = replicas
        plan = make_plan(wanted, get_inventory(self.facts.inventory))
        old = self.spec.nodes[node].replicas
        return ([e for e in plan.entries if e.node == node and e.replica >= old],
                [f for f in plan.errors if f.node == node])

    def add_entry(self, entry) -> None:
        self.plan.entries.append(entry)

    def drop_entries(self, node: str, from_replica: int) -> None:
        self.plan.entries = [e for e in self.plan.entries if not (e.node == node and e.replica >= from_replica)]

    def proc_spec(self, entry, master_port: int) -> ProcSpec:
        """What process `entry` of the plan is told about itself (written as JSON before it starts)."""
        spec = self.spec
        cls = self.classes[entry.node]
        node = spec.nodes[entry.node]
        pid = f"{entry.node}/{entry.replica}/{entry.rank}"
        if pid not in self.net.where:  # a replica added by `flowrl scale`
            self.net.place(pid, self.launcher.host_address(entry.host))
        serves = any(s.dst == entry.node for s in spec.services)
        fed = [p for p in cls.inputs if any(e.dst == entry.node and e.dst_port == p for e in spec.edges)]
        ports = [*fed, *([SERVE_PORT] if serves else [])]  # a node that only serves has no data inputs
        inputs = {p: self.address(entry.node, entry.replica, p) for p in ports}
        clients = {p: c for p in ports for c in [self.net.input_clients(entry.node, entry.replica, p)] if c is not None}
        outputs = [OutputRoute(edge=str(e), port=e.src_port,
                               addresses=[self.address(e.dst, r, e.dst_port) for r in range(spec.nodes[e.dst].replicas)],
                               capacity=self.spec.edge_capacity(e), capacity_bytes=e.capacity_bytes)
                   for e in spec.edges if e.src == entry.node]
        env = dict(self.plan.env_for(entry, master_port=master_port))
        if entry.world_size > 1:  # the group's store binds rank 0's host address, as the launcher knows it
            env["MASTER_ADDR"] = self.net.where.get(f"{entry.node}/{entry.replica}/0", env["MASTER_ADDR"])
        rank_addresses, rank_keys = self.rank_links(entry.node, entry.replica, entry.world_size)
        run_dir = self.facts.run_dir
        ps = ProcSpec(node=entry.node, kind=node.kind, replica=entry.replica, replicas=node.replicas,
                        rank=entry.rank, world_size=entry.world_size, incarnation=0, run_dir=str(run_dir),
                        graph_file=str(run_dir / "graph.yaml"), control=self.net.control_address(pid), inputs=inputs,
                        outputs=outputs, env=env, device_type=entry.device_type, devices=list(entry.devices),
                        cpu_cores=list(entry.local_devices) if entry.device_type == "cpu" else [],
                        is_sink=entry.node in self.roles.sinks, is_source=entry.node in self.roles.sources,
                        faults=list(self.facts.faults), heartbeat_s=spec.supervision.heartbeat_s,
                        peer_timeout_s=spec.supervision.peer_timeout_s, secret=self.facts.secret,
                        serving_dtype=next((spec.nodes[w.dst].dtype for w in spec.weights if w.src == entry.node), None),
                        sys_path=[p for p in sys.path if p and os.path.isdir(p)], rank_addresses=rank_addresses,
                        rank_keys=rank_keys, rank_clients=self.net.rank_clients(entry.node, entry.replica, entry.rank)
                        if entry.world_size > 1 else None,
                        host=getattr(entry, "host", None), host_address=self.net.where[pid],
                        curve_public=self.net.keys[pid][0], curve_secret=self.net.keys[pid][1],
                        control_key=self.net.control_key(pid), input_clients=clients,
                        services=[s.dst for s in spec.services if s.src == entry.node],
                        turn_group=self.turns.book.groups.get(entry.node), colocation=self.colocation.get(entry.node),
                        turn_timeout_s=2 * spec.supervision.process_timeout_s + spec.supervision.startup_timeout_s)
        self.place_home(ps)
        return ps

    def place_home(self, ps: ProcSpec) -> None:
        """Its host's run folder (`launcher.host_dirs`; none: the run directory), decided again at
        every start since a re-plan may move it. Such a host gets the graph's text in the spec."""
        run_dir, dirs = self.facts.run_dir, self.spec.launcher.host_dirs
        own = host_folder(run_dir, dirs, ps.host) if ps.host in dirs else None
        ps.own_dir = str(own) if own is not None else None
        ps.graph_file = str((own or run_dir) / "graph.yaml")
        ps.graph_text = (run_dir / "graph.yaml").read_text() if own is not None else ""
        uri = self.spec.launcher.checkpoint_uri
        ps.checkpoint_copy = str(Path(uri) / Path(run_dir).absolute().name) if uri else None

    def prepare_start(self, proc: Proc) -> None:
        """Where a (re)started process begins: the current epoch, the committed checkpoint."""
        ps = proc.spec
        ps.epoch = self.book.epoch
        ps.steps = self.scheduler.steps
        self.place_home(ps)
        if ps.node in self.roles.stateful:
            ps.resume_from = self.book.file_for(proc.id, ps.home)
            ps.watermark = self.book.committed_step
        elif ps.node in self.roles.sinks:
            ps.watermark = self.scheduler.complete_below
            ps.consumed = self.scheduler.consumed_above(ps.node, ps.watermark)

    async def after_ready(self, proc: Proc) -> None:
        """Wire outputs once every consumer can receive: all at the start, a restarted one at once."""
        if not self.started:
            if all(p.ready for p in self.procs):
                self.started = True
                for p in self.procs:
                    await self.send(p, m.Wire(routes=self.routes_for(p)))
            return
        if self.reachable(proc):
            await self.send(proc, m.Wire(routes=self.routes_for(proc)))
        # producers that waited for this consumer: its address is known now (a moved consumer binds anew)
        for p in self.producers_of(proc.spec.node):
            if p is not proc and p.ready and not p.wired and p.down_since is None and self.reachable(p):
                await self.send(p, m.Wire(routes=self.routes_for(p)))

    def producers_of(self, node: str) -> list[Proc]:
        srcs = {e.src for e in self.spec.edges if e.dst == node} | {s.src for s in self.spec.services if s.dst == node}
        return [p for p in self.procs if p.spec.node in srcs]

    def reachable(self, proc: Proc) -> bool:
        """Whether every consumer `proc` sends to is up (READY): a restarted producer is wired only
        then, since a consumer that is down may come back at another address (moved to another host)
        and a Wire to its old one would hold the producer in a connect until peer_timeout_s."""
        dsts = {e.dst for e in self.spec.edges if e.src == proc.spec.node} | set(proc.spec.services)
        return all(p.ready for p in self.procs if p.spec.node in dsts and p.spec.rank == 0 and not p.retired)


def make_sockdir() -> Path:
    """A private folder for this run's sockets; folders of runs whose controller died go first."""
    tmp = Path(tempfile.gettempdir())
    for old in tmp.glob("flowrl-*"):
        try:
            pid = int((old / "pid").read_text())
            if old.stat().st_uid != os.getuid():
                continue
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(old, ignore_errors=True)
        except (OSError, ValueError):
            continue
    path = Path(tempfile.mkdtemp(prefix="flowrl-"))
    os.chmod(path, 0o700)
    (path / "pid").write_text(str(os.getpid()))
    return path
