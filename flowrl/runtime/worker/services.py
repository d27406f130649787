"""Services: request/reply paths beside the data edges (`services: [agent -> rollout]`).

    # the client's process (an agent): one ServiceClient per service, reached by the node as
    gen = ctx.services["rollout"]                      # a flowrl.agents.base.Generator
    out = await gen.complete(prompt_ids, session="t3:0:5", max_new_tokens=32, stop=(eos,),
                             min_version=ticket.min_policy_version, seed=7)
    # the server's process (a rollout): ServiceServer binds a ROUTER, each request runs the node's
    # `serve` hook on the compute thread once the process holds the request's version

Why not a data edge: an agent's episode asks for many model turns, each of which must come back
to the same episode; tickets flow one way. Services carry no exactly-once accounting (the agent's
output batch on its data edge does): a request may be served twice (a retry after a replica died
while its first answer was on the way) and the second answer is dropped by request id.

What holds:
- Routing: a session (episode) sticks to the replica that served it while that replica is up (its
  prefix cache holds the conversation); a new session goes to the up replica with the fewest
  requests in flight from this client.
- A replica that dies mid-request: its connection drops (a ZeroMQ monitor event on the client's
  socket; the controller kills a hung one, which drops it too), and every request in flight there
  is sent again to another up replica -- or to the same one, queued until its restart binds again
  when none is up. Every request has a deadline (`timeout_s`, default the node's); past it the
  caller gets `ServiceError`, never a hang.
- The version gate: a request carries its ticket's `min_version`; the server starts it only once
  its process holds that version (or answers an error at the deadline).
- A garbled request is counted and dropped by the server; a reply for a request no longer pending
  (answered already, or given up) is dropped by the client.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from flowrl.agents.base import Completion, ServiceError
from flowrl.runtime.protocol.addresses import SERVE_PORT
from flowrl.runtime.worker.serving import REQUEST_TIMEOUT_S, ServiceServer, _context, _decode, _encode

log = logging.getLogger("flowrl.services")


# the client ---------------------------------------------------------------------------------------
@dataclass
class _Replica:
    """One server replica as this client sees it: its socket, whether it is connected, what it holds."""

    address: str
    sock: Any
    mon: Any = None  # the socket's monitor (connected / disconnected events)
    up: bool = False
    load: int = 0
    tasks: list = field(default_factory=list)


@dataclass
class _Pending:
    rid: str
    frames: list
    session: str
    future: asyncio.Future
    replica: int = -1
    sends: int = 0


class ServiceClient:
    """The client side of one service in a node process; runs on the worker's event loop."""

    def __init__(self, name: str, *, recorder: Any = None, curve=None, on_request=None) -> None:
        self.name = name  # the server node's name
        self.recorder = recorder
        self.curve = curve  # key -> CurveConfig for a tcp server (None: plain)
        self.ctx = _context()
        self.replicas: list[_Replica] = []
        self.pending: dict[str, _Pending] = {}
        self.sessions: dict[str, int] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.wired: asyncio.Event | None = None
        self.retries = 0
        self.on_request = on_request  # fault injection: called with each request's number
        self.sent = 0

    def handle(self, default_timeout_s: float = REQUEST_TIMEOUT_S) -> "ServiceHandle":
        return ServiceHandle(self, default_timeout_s)

    def bind_loop(self) -> None:
        """Called on the event loop before anything is sent (the worker's setup)."""
        self.loop = asyncio.get_running_loop()
        self.wired = asyncio.Event()

    async def connect(self, routes: list) -> None:
        """The server's replicas as the controller wired them: [[address, CURVE key or ""], ...]."""
        for address, key in routes:
            self._add(address, key)
        self.wired.set()

    async def rewire(self, msg) -> None:
        """`Connect` (a replica added or moved) / `Disconnect` (removed) for this service."""
        from flowrl.runtime.protocol import messages as m

        if isinstance(msg, m.Connect):
            if all(r.address != msg.address for r in self.replicas):
                self._add(msg.address, msg.key or "")
            return
        for i, rep in enumerate(self.replicas):
            if rep.address == msg.address:
                self.replicas.pop(i)
                self._close(rep)
                # sessions and requests there move on; indices above shift down by one
                self.sessions = {s: (r - (r > i)) for s, r in self.sessions.items() if r != i}
                for p in self.pending.values():
                    if p.replica == i:
                        p.replica = -1
                    elif p.replica > i:
                        p.replica -= 1
                for p in [p for p in self.pending.values() if p.replica == -1]:
                    self._send(p, exclude=None)
                return

    def _add(self, address: str, key: str) -> None:
        from flowrl.transport.security import apply_client

        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if key and self.curve is not None:
            apply_client(sock, self.curve(key))
        mon = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sock.connect(address)
        rep = _Replica(address, sock, mon)
        self.replicas.append(rep)
        rep.tasks = [self.loop.create_task(self._recv_loop(rep)), self.loop.create_task(self._monitor_loop(rep))]

    def _close(self, rep: _Replica) -> None:
        for t in rep.tasks:
            t.cancel()
        try:
            rep.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        rep.mon.close(linger=0)
        rep.sock.close(linger=0)

    def close(self) -> None:
        for rep in self.replicas:
            self._close(rep)
        self.replicas.clear()
        for p in self.pending.values():
            if not p.future.done():
                p.future.set_exception(ServiceError(f"service {self.name!r}: the process is stopping"))
        self.pending.clear()

    def _pick(self, session: str, exclude: int | None) -> int:
        """The session's replica while it is up; else the least-loaded up one; else any (queued)."""
        sticky = self.sessions.get(session)
        if sticky is not None and sticky != exclude and sticky < len(self.replicas) and self.replicas[sticky].up:
            return sticky
        order = [i for i in range(len(self.replicas)) if i != exclude] or list(range(len(self.replicas)))
        up = [i for i in order if self.replicas[i].up] or order
        return min(up, key=lambda i: (self.replicas[i].load, i))

    def _send(self, p: _Pending, exclude: int | None) -> None:
        i = self._pick(p.session, exclude)
        if p.replica >= 0 and p.replica < len(self.replicas):
            self.replicas[p.replica].load -= 1
        p.replica = i
        p.sends += 1
        self.sessions[p.session] = i
        rep = self.replicas[i]
        rep.load += 1
        rep.sock.send_multipart(p.frames, copy=False)

    async def request(self, meta: dict, prompt: np.ndarray, session: str, timeout_s: float) -> Completion:
        """Send one request and wait for its answer, across retries, within `timeout_s`."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        try:
            await asyncio.wait_for(self.wired.wait(), timeout_s)
        except asyncio.TimeoutError:
            raise ServiceError(f"service {self.name!r}: not wired within {timeout_s:.0f} s") from None
        if not self.replicas:
            raise ServiceError(f"service {self.name!r} has no replicas (scaled to 0?)")
        rid = uuid.uuid4().hex
        left = max(0.0, deadline - time.monotonic())  # the server gives up a little sooner, so its reason comes back
        frames = _encode({**meta, "session": session, "deadline_s": left - min(1.0, 0.1 * left)},
                         {"prompt": prompt}, rid)
        p = _Pending(rid, frames, session, self.loop.create_future())
        if self.on_request is not None:
            self.on_request(self.sent)
        self.sent += 1
        self.pending[rid] = p
        self._send(p, exclude=None)
        try:
            reply = await asyncio.wait_for(asyncio.shield(p.future), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise ServiceError(f"service {self.name!r}: no answer within {timeout_s:.1f} s (session {session}, "
                               f"sent {p.sends} time(s), last to replica {p.replica}); raise the agent's "
                               "request_timeout_s or look at the rollout's log") from None
        finally:
            if self.pending.pop(rid, None) is not None and 0 <= p.replica < len(self.replicas):
                self.replicas[p.replica].load -= 1
        if self.recorder is not None:
            took = time.monotonic() - t0
            self.recorder.observe("service_latency_s", took)
            self.recorder.observe("service_latency_s", took, server=f"{self.name}.{reply.replica}")
            self.recorder.count("service_requests", 1)
        return reply

    async def _recv_loop(self, rep: _Replica) -> None:
        while True:
            frames = await rep.sock.recv_multipart(copy=False)
            try:
                batch = _decode(frames)
            except Exception as e:  # noqa: BLE001 - a garbled reply is dropped; the request retries or times out
                log.warning("service %s: dropped a bad reply from %s: %s", self.name, rep.address, e)
                continue
            p = self.pending.get(batch.batch_id)
            if p is None or p.future.done():
                continue  # answered already (a retry's twin), or given up
            meta = batch.meta
            if meta.get("error"):
                p.future.set_exception(ServiceError(f"service {self.name!r} replica {meta.get('replica')}: {meta['error']}"))
                continue
            t = batch.tensors
            p.future.set_result(Completion(
                tokens=np.asarray(t["tokens"]).tolist(), logprobs=np.asarray(t["logprobs"]).tolist(),
                versions=np.asarray(t["versions"]).tolist(), finish=str(meta.get("finish", "stop")),
                replica=int(meta.get("replica", -1)), temperature=float(meta.get("temperature", 1.0)),
                top_p=float(meta.get("top_p", 1.0))))

    async def _monitor_loop(self, rep: _Replica) -> None:
        from zmq.utils.monitor import parse_monitor_message

        while True:
            event = parse_monitor_message(await rep.mon.recv_multipart())["event"]
            if event == zmq.EVENT_CONNECTED:
                rep.up = True
            elif event == zmq.EVENT_DISCONNECTED and rep.up:
                rep.up = False
                i = self.replicas.index(rep)
                lost = [p for p in self.pending.values() if p.replica == i and not p.future.done()]
                if lost:
                    log.warning("service %s: replica %d (%s) went away with %d request(s) in flight; sending "
                                "them again", self.name, i, rep.address, len(lost))
                for p in lost:
                    self.retries += 1
                    if self.recorder is not None:
                        self.recorder.count("service_retries", 1)
                    self._send(p, exclude=i)


class ServiceHandle:
    """What a node sees (`ctx.services[name]`): a `Generator` whose calls, made on the compute
    thread, run on the event loop's `ServiceClient`."""

    def __init__(self, client: ServiceClient, default_timeout_s: float) -> None:
        self.client = client
        self.default_timeout_s = default_timeout_s

    async def complete(self, prompt, *, session: str, max_new_tokens: int, stop=(), min_version: int = 0,
                       seed: int = 0, timeout_s: float | None = None, tokenizer: dict | None = None) -> Completion:
        meta = {"max_new_tokens": int(max_new_tokens), "stop": [int(s) for s in stop], "seed": int(seed),
                "min_version": int(min_version)}
        if tokenizer is not None:
            meta["tokenizer"] = tokenizer
        ids = np.asarray(prompt, dtype=np.int64).reshape(-1)
        coro = self.client.request(meta, ids, session, float(timeout_s or self.default_timeout_s))
        loop = self.client.loop
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))


class Services(dict):
    """`ctx.services`: service name -> handle, with an error naming the graph's services."""

    def __missing__(self, name):
        have = ", ".join(sorted(self)) or "none"
        raise KeyError(f"this node has no service {name!r} (its services: {have}); declare it in the graph: "
                       f"`services: [<this node> -> {name}]`")


class ServiceEnds:
    """A node process's ends of its services: a client per `services: [this node -> server]`, and
    a server when `services: [client -> this node]` (its address is the pseudo input SERVE_PORT).
    The worker calls these at its start-up, wiring, rewiring and close."""

    def __init__(self, spec, faults) -> None:
        self.spec, self.faults = spec, faults
        self.clients: dict[str, ServiceClient] = {}
        self.server: ServiceServer | None = None

    def open_clients(self) -> Services:
        """One client per service this node uses; the node sees them as `ctx.services` (wired later)."""
        from flowrl.runtime.protocol.addresses import output_curve

        handles = Services()
        for name in self.spec.services:
            client = ServiceClient(name, curve=lambda key: output_curve(self.spec, key),
                                   on_request=self.faults.on_request)
            client.bind_loop()
            self.clients[name] = client
            handles[name] = client.handle()
        return handles

    def attach(self, parts) -> None:
        """Once the node is set up: metrics for the clients; the server bound (rank 0 of a server)."""
        from flowrl.runtime.protocol.addresses import input_security

        for client in self.clients.values():
            client.recorder = parts.recorder
        spec = self.spec
        if spec.rank != 0 or SERVE_PORT not in spec.inputs:
            return
        node, address = parts.runner.node, spec.inputs[SERVE_PORT]
        fed = any(w.dst == spec.node for w in parts.graph.weights)  # else no version to wait for
        runner = parts.runner
        self.server = ServiceServer(spec.node, serve=lambda request: runner.serve(request["request_id"], node.serve, request),
                                    version=parts.version if fed else None, recorder=parts.recorder,
                                    replica=spec.replica, on_request=self.faults.on_request)
        self.server.bind(address, input_security(spec, SERVE_PORT, address))
        parts.version.listen(self.server.version_changed)

    def bound(self) -> dict[str, str]:
        """For READY: the address the server bound (a tcp port is chosen at bind)."""
        return {SERVE_PORT: self.server.address} if self.server is not None else {}

    async def connect(self, routes: dict | None) -> None:
        for name, client in self.clients.items():
            await client.connect((routes or {}).get(f"service:{name}", []))

    async def rewire(self, msg) -> bool:
        """A `Connect` / `Disconnect` for one of our services (True), or for a data edge (False)."""
        client = self.clients.get(msg.edge.removeprefix("service:")) if msg.edge.startswith("service:") else None
        if client is None:
            return False
        await client.rewire(msg)
        return True

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        if self.server is not None:
            self.server.close()
