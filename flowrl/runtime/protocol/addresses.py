"""Where each process of a run listens, and what protects each link: the one place that decides.

    net = Network(spec, classes, sockdir, controller_address="10.0.0.1", curve=True)
    net.place("rollout/0/0", "10.0.0.2")          # every process's host address, from the launcher
    net.input_address("reward", 0, "in")          # ipc://SOCKDIR/reward.0.in  or  tcp://10.0.0.2:0
    net.input_clients("reward", 0, "in")          # CURVE: the producers' public keys, or None
    net.control_address("rollout/0/0")            # ipc:// on the controller's host, else tcp

Both launchers go through here; the local one places every process at 127.0.0.1, so everything
stays ipc. The rules (docs/multi-host.md):

| link | both ends on one host | ends on two hosts |
|---|---|---|
| data edge (one consumer port) | ipc in the run's 0700 socket folder | tcp bound to the consumer's host address (port chosen at bind, reported in READY) + CURVE |
| control (node -> controller) | ipc | tcp bound to the controller's host address + CURVE |
| weight store | the publisher's host address | the same; keys and values sealed by the run's secret |
| shard channel (one rank's, from its data-parallel peers) | ipc | tcp on the rank's host address, port picked free there before start + CURVE |
| a replica's torch.distributed group | its store on rank 0's host address | the same, sealed by the run's secret; gloo/NCCL on the interface that holds each rank's host address |

"One host" means one address: two Ray nodes that share an IP address share a machine. A consumer
port binds tcp as soon as one of its producers runs elsewhere (its producers on its own host then
reach it over tcp too). CURVE keys: one pair per process and one for the controller, made here
per run; a process gets its own secret key and the public keys it needs (ProcSpec; under Ray in
the actor call's memory, never a file on the remote host). A consumer admits only its producers'
keys, the controller only the run's processes' keys. The per-run secret proof still runs inside.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable

import zmq

log = logging.getLogger("flowrl.controller")

LOOPBACK = "127.0.0.1"
CONTROL_DOMAIN = "flowrl-control"  # the control's ZAP domain (data channels have their own)


def shard_address(sockdir: str, node: str, replica: int, rank: int) -> str:
    """Where rank `rank` of a data-parallel replica takes its shards from its leader (its peers on its host)."""
    return f"ipc://{sockdir}/{node}.{replica}.rank{rank}"


def free_port(address: str = LOOPBACK) -> int:
    """A TCP port free now on `address`, one of this machine's (a group's MASTER_PORT, a rank's
    shard channel); a launcher's `free_port` asks the host that has the address."""
    import socket

    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def keypair() -> tuple[str, str]:
    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()


def tcp_address(host: str, port: int | str = 0) -> str:
    """`tcp://HOST:PORT`, IPv6 in brackets; never all interfaces."""
    if host in ("", "0.0.0.0", "::", "*"):
        raise ValueError(f"a flowrl socket binds to its host's cluster address, not {host!r} (all interfaces)")
    try:
        bracket = isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address)
    except ValueError:
        bracket = False
    return f"tcp://[{host}]:{port}" if bracket else f"tcp://{host}:{port}"


SERVE_PORT = "@serve"
"""The pseudo input port a service's server binds its request socket as (`ProcSpec.inputs`, READY):
the controller tracks its address like a data input's and tells the clients where it moved."""


class Network:
    """Hosts, addresses and CURVE keys of one run's processes (mutable: a re-plan moves processes)."""

    def __init__(self, spec, classes: dict, sockdir, controller_address: str = LOOPBACK, *, curve: bool = True):
        self.spec, self.classes, self.sockdir = spec, classes, str(sockdir)
        self.controller_address = controller_address
        self.curve = curve
        self.where: dict[str, str] = {}  # process id -> its host's cluster address
        self.keys: dict[str, tuple[str, str]] = {}  # process id -> (public, secret), Z85
        self.control_keys = keypair()
        self.control_tcp: str | None = None  # the controller's tcp address, once bound
        self.rank_ports: dict[tuple, tuple[str, int]] = {}  # (node, replica, rank) -> (host address, its tcp port)

    def place(self, proc_id: str, address: str) -> None:
        self.where[proc_id] = address or LOOPBACK
        self.keys.setdefault(proc_id, keypair())

    def forget(self, proc_id: str) -> None:
        """A process `flowrl scale` removed: its host and keys go (its consumers and the control
        stop admitting it: `revoke_control`, an `Admit` order to each consumer)."""
        self.where.pop(proc_id, None)
        self.keys.pop(proc_id, None)

    @property
    def multi_host(self) -> bool:
        """Some process runs on another host than the controller: control goes over tcp too."""
        return any(a != self.controller_address for a in self.where.values())

    def producers(self, node: str, port: str) -> list[str]:
        """Every process that may send into `node.port` (all ranks of every upstream node)."""
        if port == SERVE_PORT:
            srcs = {s.src for s in self.spec.services if s.dst == node}
        else:
            srcs = {e.src for e in self.spec.edges if e.dst == node and e.dst_port in (None, port)}
        return [p for p in self.where if p.split("/")[0] in srcs]

    def crosses(self, node: str, replica: int, port: str) -> bool:
        me = self.where[f"{node}/{replica}/0"]
        return any(self.where[p] != me for p in self.producers(node, port))

    def input_address(self, node: str, replica: int, port: str) -> str:
        """What the consumer binds: ipc when its producers share its host, else tcp on its host's
        address with the port left to the kernel (the bound address comes back in READY)."""
        if not self.crosses(node, replica, port):
            return f"ipc://{self.sockdir}/{node}.{replica}.{port}"
        return tcp_address(self.where[f"{node}/{replica}/0"], 0)

    def input_clients(self, node: str, replica: int, port: str) -> list[str] | None:
        """CURVE on a tcp input: the public keys of the producers it admits (None: no CURVE)."""
        if not self.curve or not self.crosses(node, replica, port):
            return None
        return sorted(self.keys[p][0] for p in self.producers(node, port))

    def server_key(self, node: str, replica: int, address: str) -> str:
        """The public key a producer must expect at `address` of that consumer ('' for none)."""
        return self.keys[f"{node}/{replica}/0"][0] if self.curve and address.startswith("tcp://") else ""

    def control_address(self, proc_id: str) -> str:
        if self.where.get(proc_id, self.controller_address) == self.controller_address or self.control_tcp is None:
            return f"ipc://{self.sockdir}/control"
        return self.control_tcp

    def control_key(self, proc_id: str) -> str | None:
        address = self.control_address(proc_id)
        return self.control_keys[0] if self.curve and address.startswith("tcp://") else None

    # the ranks of one data-parallel replica ----------------------------------------------------
    def rank_peers(self, node: str, replica: int, rank: int) -> list[str]:
        """Who sends into `rank`'s shard channel: every follower into the leader's, the leader into
        a follower's."""
        if rank:
            return [f"{node}/{replica}/0"]
        return [p for p in self.where if p.startswith(f"{node}/{replica}/") and not p.endswith("/0")]

    def rank_crosses(self, node: str, replica: int, rank: int) -> bool:
        me = self.where[f"{node}/{replica}/{rank}"]
        return any(self.where[p] != me for p in self.rank_peers(node, replica, rank))

    def rank_address(self, node: str, replica: int, rank: int, port: Callable[[str], int]) -> str:
        """Where `rank` takes its shards (a follower) or its followers' replies (the leader): ipc when
        its peers share its host, else tcp on its host's address at `port(address)` (a port picked
        free there: its peers are told the address before it starts, so it is fixed, as ipc is)."""
        if not self.rank_crosses(node, replica, rank):
            return shard_address(self.sockdir, node, replica, rank)
        host = self.where[f"{node}/{replica}/{rank}"]
        return tcp_address(host, port(host))

    def rank_links(self, node: str, replica: int, world_size: int,
                   free_port: Callable[[str], int]) -> tuple[list[str], list[str]]:
        """Where each rank of a replica takes its shards, and the CURVE key to expect there. A tcp
        port is picked free on the rank's host once (`free_port(address)`, the launcher's) and kept
        while the rank stays there: its restarts bind it again, as they would an ipc path."""
        if world_size < 2:
            return [], []
        addresses, keys = [], []
        for r in range(world_size):
            def port(host: str, key=(node, replica, r)) -> int:
                if self.rank_ports.get(key, (None,))[0] != host:
                    self.rank_ports[key] = (host, free_port(host))
                return self.rank_ports[key][1]
            address = self.rank_address(node, replica, r, port)
            addresses.append(address)
            keys.append(self.rank_key(node, replica, r, address))
        return addresses, keys

    def rank_clients(self, node: str, replica: int, rank: int) -> list[str] | None:
        """CURVE on a tcp shard channel: the public keys of the ranks it admits (None: no CURVE)."""
        if not self.curve or not self.rank_crosses(node, replica, rank):
            return None
        return sorted(self.keys[p][0] for p in self.rank_peers(node, replica, rank))

    def rank_key(self, node: str, replica: int, rank: int, address: str) -> str:
        """The public key a peer must expect at `rank`'s shard channel ('' for ipc or no CURVE)."""
        return self.keys[f"{node}/{replica}/{rank}"][0] if self.curve and address.startswith("tcp://") else ""


def connect_control(ctx, spec, suffix: str = "", linger_ms: int = 0, sndhwm: int | None = None):
    """A node's DEALER to the controller's control socket (the worker's, or its heartbeat thread's
    with `suffix` "#hb"): identified as this incarnation, CURVE client when the control is tcp."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"{spec.proc_id}#{spec.incarnation}{suffix}".encode())
    sock.setsockopt(zmq.LINGER, linger_ms)
    if sndhwm is not None:
        sock.setsockopt(zmq.SNDHWM, sndhwm)
    if spec.control_key:
        from flowrl.transport import CurveConfig, security

        security.apply_client(sock, CurveConfig(server_public=spec.control_key, client_public=spec.curve_public,
                                                client_secret=spec.curve_secret))
    sock.connect(spec.control)
    return sock


def bind_control(net: Network):
    """The controller's control ROUTER: ipc for its own host's processes (and `flowrl scale`);
    when a process runs on another host, also tcp on the controller's host address with CURVE,
    admitting only the keys of this run's processes. Returns (context, socket)."""
    from flowrl.transport import CurveConfig, security
    from flowrl.transport.sockets import shared_context

    multi = net.multi_host
    # CURVE's ZAP handler lives in the transport's process-wide context: share it then
    zctx = shared_context() if multi else zmq.Context()
    router = zctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"ipc://{net.sockdir}/control")  # options are copied at bind: this endpoint has no CURVE
    if multi:
        if net.curve:
            public, secret = net.control_keys
            security.apply_server(router, CurveConfig(server_public=public, server_secret=secret,
                                                      authorized_clients=tuple(k for k, _ in net.keys.values())),
                                  CONTROL_DOMAIN)
        router.bind(tcp_address(net.controller_address, "*"))
        net.control_tcp = router.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info("control channel on %s (%s)", net.control_tcp, "CURVE" if net.curve else "no CURVE")
    return zctx, router


def admit_control(net: Network, add=(), remove=()) -> None:
    """The tcp control admits these processes' public keys from now on, and refuses those (a
    replica added or removed by `flowrl scale`); nothing to do without CURVE on the control."""
    from flowrl.transport import security

    if net.control_tcp and net.curve:
        security.admit(CONTROL_DOMAIN, add)
        security.revoke(CONTROL_DOMAIN, remove)


def admit_producers(spec, receivers: dict, msg) -> None:
    """A node's side of an `Admit` order: its input `msg.port` admits and refuses these producer keys
    (its CURVE server's ZAP set, security.py), and its spec says so too."""
    from flowrl.transport import security

    add, remove = list(msg.add or []), list(msg.remove or [])
    if msg.port == SERVE_PORT:
        security.admit(f"service:{spec.node}", add)
        security.revoke(f"service:{spec.node}", remove)
    elif msg.port in receivers:
        receivers[msg.port].admit(add, remove)
    if msg.port in spec.input_clients:
        keys = set(spec.input_clients[msg.port]) | set(add)
        spec.input_clients[msg.port] = sorted(keys - set(remove))
    log.info("input %s admits %d producer key(s) more, %d fewer", msg.port, len(add), len(remove))


def release_control(net: Network, zctx) -> None:
    """After the ROUTER closed: the ZAP domain goes; a private context is ended (the shared one stays)."""
    if net.control_tcp:
        from flowrl.transport import security

        security.release(CONTROL_DOMAIN)
    else:
        zctx.term()


def input_security(spec, port: str, address: str) -> dict:
    """ChannelConfig fields of a node's input: a tcp input (a producer on another host) binds its
    host's address, as CURVE server with the process's keys, admitting the producers' keys only."""
    from flowrl.transport import CurveConfig

    if not address.startswith("tcp://"):
        return {}
    clients = spec.input_clients.get(port)
    curve = None if clients is None else CurveConfig(
        server_public=spec.curve_public, server_secret=spec.curve_secret, authorized_clients=tuple(clients))
    return {"transport": "tcp", "allow_remote": True, "curve": curve}


def rank_security(spec, address: str) -> dict:
    """ChannelConfig fields of a rank's shard channel: across hosts a tcp bind on its host address,
    CURVE server admitting only its data-parallel peers' keys (`ProcSpec.rank_clients`)."""
    from flowrl.transport import CurveConfig

    if not address.startswith("tcp://"):
        return {}
    clients = spec.rank_clients
    curve = None if clients is None else CurveConfig(
        server_public=spec.curve_public, server_secret=spec.curve_secret, authorized_clients=tuple(clients))
    return {"transport": "tcp", "allow_remote": True, "curve": curve}


def output_curve(spec, key: str | None):
    """CURVE client keys for a consumer on another host (`key`: its public key, from the controller)."""
    from flowrl.transport import CurveConfig

    if not key:
        return None
    return CurveConfig(server_public=key, client_public=spec.curve_public, client_secret=spec.curve_secret)
