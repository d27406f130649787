"""`Receiver`: the consumer end of a channel. It binds; producers connect to it.

    async with Receiver(ChannelConfig(capacity_messages=4), name="rollout->reward") as rx:
        address = await rx.bind()          # or bind("ipc:///run/x/reward") again after a crash
        while True:
            try:
                batch = await rx.recv()
            except EndOfStream:
                break
            ...                            # process
            await rx.ack(batch)            # frees its credit; the producer forgets the batch

Its background work (heartbeats, the acknowledgement timer) runs in a task group: the one `async
with` opens, or `Receiver(..., task_group=tg)` for an owner that has one (a node process); then
`await rx.aclose()` ends it. See tasks.py.

Memory is bounded by `capacity_messages` / `capacity_bytes`: credit for new messages is only granted
as earlier ones are acknowledged. Producer links are told apart by their ZeroMQ routing id.

How a producer's end is noticed: end-of-stream (it finished), its connection closing (ipc/tcp: the
process exited or the network failed; TCP keepalive catches vanished hosts) or, for inproc, missed
heartbeats. A closed connection is known by its routing id: the status sent to a link on every
heartbeat, and to every link whenever some connection closes, fails with EHOSTUNREACH once ZeroMQ
has dropped the link's pipe. Not by the connection's file descriptor: the monitor's "disconnected"
event and the messages that came through that connection travel on two sockets in no fixed order,
and the number is reused by the next connection (a restarted producer's, usually), so a link held
by a descriptor could stay open after its connection closed (a hello still queued when its
connection closed) or be dropped while alive (the event of an earlier connection with the same
number). A producer lost without end-of-stream is *dropped from the set whose end-of-stream
is awaited* (its replacement connects as a new link; its work is replayed upstream) and counted in
`peers_lost`. `recv()` raises `EndOfStream` once every link still alive has finished and at least one
finished. When no producer is left, none finished, and none came back within `peer_timeout_s` of the
last loss, `recv()` raises `BrokenChannel` (with the cause) once; called again, it waits for a
producer to connect (a supervisor may be restarting it).

Heartbeats and credit run on the event loop: code that blocks the loop longer than `peer_timeout_s`
makes this consumer look dead only on inproc channels (ipc/tcp liveness is ZeroMQ's, not the loop's);
a *producer* whose loop is blocked for `credit_idle_s` while it holds credit loses its link (below).

Hostile input (anything that can reach the socket): a link is known only after a hello that proves
the channel's secret (when one is set); messages from unknown links are looked at only if they are
small (PRE_HELLO_BYTES) and answered at a bounded rate; a known link's message is measured against
its credit before its header is unpacked; a replayed sequence number, a `need` above the link's cap
and a link that sits on granted credit (credit_idle_s) are refused or cut off. See docs/transport.md.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from typing import Any

import zmq
from anyio.abc import TaskGroup
from zmq.utils.monitor import parse_monitor_message

from flowrl.transport import codec, security, shm, sockets, wire
from flowrl.transport.batch import Batch
from flowrl.transport.config import ChannelConfig
from flowrl.transport.pick import endpoint_for
from flowrl.transport.errors import AddressInUse, BrokenChannel, ChannelClosed, DecodeError, EndOfStream
from flowrl.transport.flow import CreditPool
from flowrl.transport.gate import Gate
from flowrl.transport.stats import ChannelStats
from flowrl.transport.tasks import ChannelTasks, TaskOwner

log = logging.getLogger("flowrl.transport")
ACK_DELAY_S = 0.002  # acknowledgements wait at most this long to travel together
FREED_BATCH = 2  # released shared-memory blocks go back to their producer at once from this many
SHM_MAPPING_FAILURES = frozenset({"unmappable", "too_much_mapped", "closed"})
PRE_HELLO_BYTES = 4096  # the most a link that is not known yet may send in one message (hellos are ~300 B)
PROBE_AGAIN_S = 0.01  # after a connection closed, links are asked again this much later (_on_monitor)
CONTROL_ALLOWANCE = 4096  # what a known link's message may carry beyond its credit (hellos, bundle header)


class _Peer:
    __slots__ = ("rid", "state", "last_heard", "last_data", "unacked", "acks", "dirty", "shm", "shm_tried",
                 "proof", "max_seq")

    def __init__(self, rid: bytes, proof: bytes | None):
        self.rid, self.state, self.proof = rid, "open", proof
        self.max_seq = 0  # sequence numbers on a link only grow: anything at or below is a replay
        self.shm: shm.ShmPeer | None = None  # the producer's shared memory, once its probe mapped
        self.shm_tried = False
        self.last_heard = self.last_data = time.monotonic()
        self.unacked: dict[int, int] = {}  # seq -> bytes, received and not yet acknowledged
        self.acks: list[int] = []          # acknowledged, not yet told to the producer
        self.dirty = True                  # a status is owed


class Receiver(TaskOwner):
    """Consumer end of one channel; see the module docstring."""

    def __init__(self, config: ChannelConfig | None = None, *, name: str = "channel",
                 task_group: TaskGroup | None = None):
        """`task_group`: where the channel's background work runs (it must outlive the channel:
        `aclose()` it first); without one, use the Receiver as `async with`, which opens one."""
        self.config = config or ChannelConfig()
        self.name = name
        self.address: str | None = None
        self._limits = self.config.limits()
        self._inc = secrets.token_hex(8)
        self._link_m, self._link_b = self.config.link_caps()
        self._pool = CreditPool(self.config.capacity_messages, self.config.capacity_bytes, self._link_m, self._link_b)
        secret = None if self.config.secret is None else self.config.secret.get_secret_value()
        self._gate = Gate(secret, self.config.heartbeat_s)
        self._credit_idle_s = self.config.credit_idle()
        self._peers: dict[bytes, _Peer] = {}
        self._gone: set[bytes] = set()
        self._orphans: dict[tuple[bytes, int], int] = {}
        self._ready: deque[Batch] = deque()
        self._outbox: list[tuple[bytes, bytes]] = []
        self._state = "new"
        self._ever_connected = False
        self._finished = 0
        self._lost: tuple[float, str] | None = None
        self._changed = asyncio.Event()
        self._unflushed = 0
        self._flush_every = max(1, self.config.capacity_messages // 4)
        self._flush_at: float | None = None  # when acknowledgements held back by ack() go out (_ack_timer)
        self._flush_armed = asyncio.Event()  # wakes _ack_timer
        self._blocked: set[bytes] = set()  # links waiting for credit
        self._urgent = False  # a hello or a lost link changed the credit picture: flush now
        self._work = ChannelTasks(f"receiver {name!r}", task_group)
        self._pump: Any = None
        self._mon: Any = None
        self._endpoint: Any = None
        self._domain = ""
        self._c = dict(received=0, received_bytes=0, acked=0, rejected=0, peers_lost=0, shm=0, shm_bytes=0,
                       reclaimed=0)
        self._rejects: dict[str, int] = {}
        self._now = time.monotonic()  # when the messages being handled arrived
        self._shm_refused: set[int] = set()  # producer processes whose shared memory failed us
        self._plans = codec.Plans()  # how the last plain batch was decoded (codec.Plans)

    # ------------------------------------------------------------------------------- public API
    async def bind(self, address: str | None = None) -> str:
        """Bind `address` (or a fresh one of `config.transport`); returns the bound address."""
        if self._state != "new":
            raise RuntimeError(f"receiver {self.name!r} is already bound (or closed); make a new one")
        self._endpoint = endpoint_for(address or self.config.transport, self.config, self.name)
        sock = sockets.router(self.config)
        self._domain = f"flowrl-{self._inc}"
        try:
            security.apply_server(sock, self.config.curve, self._domain)
            mon = None if self._endpoint.scheme == "inproc" else sockets.monitor(sock, zmq.EVENT_DISCONNECTED)
            self.address = await self._bind_retrying(sock, address)
            await self._work.start()
        except BaseException:
            sockets.close(sock)
            security.release(self._domain)
            raise
        self._state = "bound"
        self._changed = asyncio.Event()
        self._mon = None if mon is None else sockets.Pump(mon, self._on_monitor, copy=True)
        self._pump = sockets.Pump(sock, self._on_messages)
        self._pump.on_send_error = self._on_send_error
        self._work.spawn(self._tick_loop)
        self._work.spawn(self._ack_timer)
        return self.address

    async def _bind_retrying(self, sock: Any, address: str | None) -> str:
        """A consumer restarted at its old address may find the old socket still closing (another
        process exiting, or ZeroMQ's asynchronous close): retry for up to `peer_timeout_s`."""
        deadline = time.monotonic() + self.config.peer_timeout_s
        while True:
            try:
                return self._endpoint.bind(sock, address)
            except (AddressInUse, zmq.ZMQError) as e:
                in_use = isinstance(e, AddressInUse) or e.errno == zmq.EADDRINUSE
                if not in_use or address is None or time.monotonic() > deadline:
                    if in_use and not isinstance(e, AddressInUse):
                        raise AddressInUse(f"{address} is in use: {e}") from e
                    raise
            await asyncio.sleep(0.02)

    async def recv(self) -> Batch:
        """The next batch; waits for one. Raises EndOfStream, BrokenChannel or ChannelClosed."""
        while True:
            if self._ready:
                return self._ready.popleft()
            if self._state != "bound":
                raise ChannelClosed(f"receiver {self.name!r} is {'closed' if self._state == 'closed' else 'not bound'}")
            if self._outbox or any(p.shm is not None and p.shm.freed for p in self._peers.values()):
                self._flush()
            changed = self._changed
            self._check_end()
            await changed.wait()

    async def ack(self, batch: Batch) -> None:
        """Done with `batch`: its credit returns and its producer stops holding it. Idempotent."""
        d = batch._delivery  # (link, sequence number, credit size): set by _on_data
        if type(d) is not tuple:
            raise ValueError(f"ack() needs a Batch returned by recv(); {batch.batch_id!r} has no delivery tag "
                             "(batches made by select/split/replace/concat carry none)")
        rid, seq, size = d
        peer = self._peers.get(rid)
        if peer is not None and peer.unacked.pop(seq, None) is not None:
            self._pool.on_ack(rid, size)
            peer.acks.append(seq)
            peer.dirty = True
            freed = peer.shm is not None and len(peer.shm.freed) >= FREED_BATCH
        elif self._orphans.pop((rid, seq), None) is not None:  # its link was dropped
            self._pool.on_orphan_ack(size)
            freed = False
        else:  # acknowledged before
            return
        self._c["acked"] += 1
        if self._state != "bound":
            return
        self._unflushed += 1
        if self._unflushed >= self._flush_every or freed:  # released shared memory goes back soon
            self._flush()
        elif self._flush_at is None:  # acks go out in bursts: each message wakes two threads
            self._flush_at = time.monotonic() + ACK_DELAY_S
            self._flush_armed.set()

    def admit(self, add=(), remove=()) -> None:
        """Change which producer keys this CURVE input admits (`flowrl scale` adds or removes a
        producer while it runs); a no-op without CURVE client authentication."""
        if self.config.curve is None or self.config.curve.authorized_clients is None or not self._domain:
            return
        security.admit(self._domain, add)
        security.revoke(self._domain, remove)

    def statistics(self) -> ChannelStats:
        held_m = sum(len(p.unacked) for p in self._peers.values()) + self._pool.orphan_m
        held_b = sum(sum(p.unacked.values()) for p in self._peers.values()) + self._pool.orphan_b
        return ChannelStats(
            name=self.name, role="receiver", peers=sum(p.state == "open" for p in self._peers.values()),
            in_flight=held_m, in_flight_bytes=held_b, queued=len(self._ready),
            queued_bytes=held_b, credit_messages=self._pool.free_m, credit_bytes=self._pool.free_b,
            rejected_by_reason=dict(self._rejects), challenged=self._gate.challenged,
            replies_dropped=self._gate.dropped, **self._c)

    async def aclose(self) -> None:
        """Close: producers are told (they re-send what this consumer did not acknowledge elsewhere)."""
        if self._state == "bound":
            for peer in self._peers.values():
                self._outbox.append((peer.rid, self._status(peer, closing=True)))
            self._send_outbox()
        await self._shutdown()

    def abort(self) -> None:
        """Drop the socket without telling anyone, as a crash would (fault tests)."""
        if self._state == "bound":
            self._state = "closing"
            self._work.cancel()
            self._pump.close(monitor=self._mon)
            security.release(self._domain)
            self._state = "closed"
            self._notify()


    # ------------------------------------------------------------------------------- incoming
    def _on_messages(self, msgs: list) -> None:
        self._now = time.monotonic()  # when these arrived (one clock read per drain, not per batch)
        for msg in msgs:
            try:
                self._handle(msg)
            except DecodeError as e:
                self._reject(e.reason, str(e), msg[0].bytes if msg else b"")
            except Exception:  # noqa: BLE001 - a bug must not kill the channel; it is logged
                log.exception("channel %s: internal error on an incoming message", self.name)
                self._reject("internal", "internal error", b"")
        if self._urgent or self._outbox:  # acknowledgements alone wait for their batch (see ack)
            self._flush()
        self._notify()

    def _handle(self, msg: list) -> None:
        rid = msg[0].bytes
        views, size = codec.check_frames(msg[1:], self._limits)
        peer = self._peers.get(rid)
        if peer is None:  # before its hello is accepted a link may only say hello: look at nothing bigger
            if len(views) > 2 or size > PRE_HELLO_BYTES:
                self._reply_unknown(rid)
                raise DecodeError("unknown_link", f"a {size}-byte message from link {rid[:24]!r}, which has "
                                                  "not said hello (or was given up on)")
        elif size > CONTROL_ALLOWANCE and size > self._pool.accounts[rid].unused_b + CONTROL_ALLOWANCE:
            raise DecodeError("no_credit", f"a {size}-byte message from link {rid[:24]!r}, which holds credit "
                                           f"for {self._pool.accounts[rid].unused_b} bytes")
        header = wire.unpack_header(views[0], self._limits)
        if type(header) is list:  # data
            return self._on_data(rid, header, views, size)
        if header["kind"] != wire.BUNDLE:
            return self._dispatch(rid, header, views, size)
        start, blob, limits, unpack = 0, views[-1], self._limits, wire.unpack_header
        for size in wire.bundle_parts(header, len(views), blob.nbytes):
            part = blob[start:start + size]
            start += size
            try:
                header = unpack(part, limits)
                if type(header) is list:  # data (without _dispatch's call: per batch)
                    self._on_data(rid, header, [part], size)
                else:
                    self._dispatch(rid, header, [part], size)
            except DecodeError as e:  # this part only: the others of the bundle are fine
                self._reject(e.reason, str(e), rid)
            except Exception:  # noqa: BLE001 - a bug: logged, and the bundle's other parts still go in
                log.exception("channel %s: internal error on a part of a bundle", self.name)
                self._reject("internal", "internal error", rid)

    def _dispatch(self, rid: bytes, header: dict, views: list, size: int) -> None:
        kind = header["kind"]
        if kind == wire.HELLO:
            self._on_hello(rid, wire.Hello.from_header(header))
        elif kind == wire.BUNDLE:
            raise DecodeError("bad_kind", "a bundle inside a bundle")
        else:
            raise DecodeError("bad_kind", "status messages go from consumer to producer")

    def _on_hello(self, rid: bytes, hello: wire.Hello) -> None:
        peer = self._peers.get(rid)
        try:
            if not self._gate.admit(rid, hello, peer.proof if peer is not None else None, peer is not None):
                return self._reply_unknown(rid)  # its nonce: a producer that knows the secret answers
        except DecodeError:
            if peer is None and hello.state not in ("bye", "relink"):
                self._reply_unknown(rid)
            raise
        if hello.need > self._link_b:
            raise DecodeError("need_too_large", f"link {rid[:24]!r} waits for {hello.need} bytes of credit; a "
                                                f"link gets at most {self._link_b} (link_capacity_bytes)")
        if hello.inc is not None and hello.inc != self._inc:
            # a link of an earlier incarnation at this address: its socket reconnected here (stale
            # hellos it still held); a live producer starts a new link
            if peer is None and hello.state not in ("bye", "relink"):
                self._reply_unknown(rid)
            return
        if hello.state in ("bye", "relink"):
            if peer is not None:
                quiet = hello.state == "relink" or peer.state == "eos"
                self._drop(peer, None if quiet else "closed before end-of-stream")
            return
        if peer is None:
            if rid in self._gone:  # a link we gave up on: tell it to start a new one
                self._reply_unknown(rid)
                return
            peer = self._peers[rid] = _Peer(rid, hello.mac)
            self._pool.add(rid)
            self._ever_connected = True
            log.debug("channel %s: producer link %r (%s) connected", self.name, rid, hello.ch)
        peer.last_heard = time.monotonic()
        if hello.shm is not None and not peer.shm_tried and self._endpoint.scheme == "ipc":  # one host only
            self._map_shm(peer, hello.shm)
        self._urgent = True
        self._pool.on_hello(rid, hello.need, hello.idle, hello.ret_m, hello.ret_b)
        if hello.need:
            self._blocked.add(rid)
        else:
            self._blocked.discard(rid)
        if hello.state == "eos" and peer.state == "open":
            peer.state = "eos"
            self._pool.finish(rid)
            self._finished += 1
        peer.dirty = True

    def _map_shm(self, peer: _Peer, probe: dict) -> None:
        """Try the producer's shared-memory probe once; the status says whether it worked."""
        peer.shm_tried, peer.dirty = True, True
        if not self.config.shm_bytes or probe["pid"] in self._shm_refused:
            return
        try:
            peer.shm = shm.ShmPeer(probe["pid"], probe["fd"], probe["key"], max_bytes=self.config.shm_bytes)
        except shm.ShmError as e:
            log.info("channel %s: producer link %r sends large batches over the socket: %s", self.name, peer.rid, e)

    def _on_data(self, rid: bytes, header: list, views: list, size: int) -> None:
        env = header[wire.D_ENV]
        if type(env) is not list or len(env) != 2:
            raise DecodeError("bad_field", f"env must be [incarnation, seq], got {wire.short(env)}")
        inc, seq = env
        if type(seq) is not int or seq < 0:
            raise DecodeError("bad_field", f"env.seq must be an int >= 0, got {wire.short(seq, 20)}")
        peer = self._peers.get(rid)
        if peer is None:
            self._reply_unknown(rid)
            raise DecodeError("unknown_link", f"data from link {rid[:24]!r} that sent no hello")
        if inc != self._inc:
            raise DecodeError("stale_incarnation", f"data addressed to consumer incarnation {wire.short(inc)}")
        if seq <= peer.max_seq:
            raise DecodeError("replay", f"sequence number {seq} on link {rid[:24]!r}, which is past {peer.max_seq}")
        ref, region = header[wire.D_SHM], None
        if ref is not None:
            size = self._shm_size(peer, ref, views, size)
        if not self._pool.can_accept(rid, size):
            raise DecodeError("no_credit", f"{size} bytes arrived without credit (or after end-of-stream)")
        if ref is not None:
            try:
                region = peer.shm.region(*ref)
            except shm.ShmError as e:
                if e.reason in SHM_MAPPING_FAILURES:  # a well-formed reference we cannot follow
                    self._refuse_shm(peer, e)
                raise DecodeError(e.reason, f"shared memory of batch {wire.short(header[wire.D_ID], 60)}: {e}") from None
        batch = codec.decode_data(header, views, self._limits, (rid, seq, size), region, self._plans)
        peer.max_seq, peer.last_data = seq, self._now
        self._pool.on_data(rid, size)
        if self._blocked:
            self._blocked.discard(rid)
        peer.unacked[seq] = size
        self._ready.append(batch)
        c = self._c
        c["received"] += 1
        c["received_bytes"] += size
        if ref is not None:
            c["shm"] += 1
            c["shm_bytes"] += ref[2]

    def _refuse_shm(self, peer: _Peer, error: shm.ShmError) -> None:
        """A batch in the producer's shared memory could not be mapped: give up on this link (its
        producer re-sends what we did not acknowledge, on a new link) and on shared memory with
        that producer process (the new link gets `shm_max` 0, so the re-sent batches come over the
        socket)."""
        self._shm_refused.add(peer.shm.pid)
        log.warning("channel %s: producer link %r: shared memory failed (%s); the link starts over without it",
                    self.name, peer.rid, error)
        self._drop(peer, None)

    def _shm_size(self, peer: _Peer, ref: Any, views: list, size: int) -> int:
        """Credit size of a shared-memory message (frame 0 plus the bytes it refers to), checked."""
        if peer.shm is None:
            raise DecodeError("bad_field", "a shared-memory batch from a link whose memory is not mapped")
        if type(ref) is not list or len(ref) != 3 or len(views) != 1:
            raise DecodeError("bad_field", "shm must be [block id, fd, used bytes], with frame 0 alone")
        used = ref[2]
        if type(used) is not int or not 0 <= used <= self._limits.max_message_bytes:
            raise DecodeError("bad_field", f"shm used bytes {wire.short(used, 20)} out of range")
        return size + used

    def _reject(self, reason: str, text: str, rid: bytes) -> None:
        self._c["rejected"] += 1
        n = self._rejects[reason] = self._rejects.get(reason, 0) + 1
        if n <= 5 or n % 1000 == 0:
            log.warning("channel %s: rejected a message from %r (%s; %d so far for this reason)",
                        self.name, rid[:24], text[:300], n)

    # ------------------------------------------------------------------------------- links
    def _drop(self, peer: _Peer, cause: str | None) -> None:
        self._urgent = True
        del self._peers[peer.rid]
        if peer.shm is not None:  # batches still held keep their mappings
            peer.shm.close()
        self._blocked.discard(peer.rid)
        self._gone.add(peer.rid)
        for seq, size in peer.unacked.items():
            self._orphans[(peer.rid, seq)] = size
        self._pool.remove(peer.rid)
        if cause is not None:
            self._c["peers_lost"] += 1
            self._lost = (time.monotonic(), f"producer link {peer.rid.decode(errors='replace')} of channel "
                                            f"{self.name!r}: {cause}")
            log.warning("%s", self._lost[1])
        self._notify()

    def _on_monitor(self, msgs: list) -> None:
        """A connection closed: ask every link whether it is still there (module docstring). The
        event comes before ZeroMQ drops the closed connection's pipe, so the question is asked
        again a moment later; the heartbeat's status asks it anyway."""
        if any(parse_monitor_message(frames)["event"] == zmq.EVENT_DISCONNECTED for frames in msgs):
            self._probe()
            asyncio.get_running_loop().call_later(PROBE_AGAIN_S, self._probe)

    def _probe(self) -> None:
        if self._state == "bound" and self._peers:
            for peer in self._peers.values():
                peer.dirty = True
            self._flush()

    async def _tick_loop(self) -> None:
        await sockets.tick_loop(self.config.heartbeat_s, self._tick, self.name)

    def _tick(self, now: float, stalled: bool) -> None:
        if self._mon is None and not stalled:  # inproc: no connection events, deadlines instead
            for peer in [p for p in self._peers.values() if now - p.last_heard > self.config.peer_timeout_s]:
                self._drop(peer, f"no heartbeat for {now - peer.last_heard:.1f}s" if peer.state == "open" else None)
        if stalled:  # our own loop was blocked: the links' silence is not theirs
            for peer in self._peers.values():
                peer.last_data = max(peer.last_data, now - self.config.heartbeat_s)
        if self._blocked:  # credit is reclaimed for links that wait for it, never for nobody
            for peer in [p for p in self._peers.values() if now - p.last_data > self._credit_idle_s
                         and self._pool.sits_on_credit(p.rid) and self._blocked != {p.rid}]:
                self._reclaim(peer, now)
        for peer in self._peers.values():
            peer.dirty = True
        self._flush()
        self._notify()

    def _reclaim(self, peer: _Peer, now: float) -> None:
        """A link sat on granted credit for credit_idle_s without sending: its link ends (a live
        producer starts a new one and re-sends what was not acknowledged) and the credit returns."""
        self._c["reclaimed"] += 1
        log.warning("channel %s: producer link %r held credit for %.1fs without sending; its link is ended and "
                    "the credit goes to the others", self.name, peer.rid[:24], now - peer.last_data)
        self._drop(peer, None)
        self._reply_unknown(peer.rid)

    def _check_end(self) -> None:
        if not self._ever_connected or any(p.state == "open" for p in self._peers.values()):
            return
        if self._finished:
            raise EndOfStream(f"every producer of channel {self.name!r} finished")
        if self._lost and time.monotonic() - self._lost[0] >= self.config.peer_timeout_s:
            cause, self._lost = self._lost[1], None  # reported once: a retried recv() waits for producers
            raise BrokenChannel(f"{cause}; no producer connected within {self.config.peer_timeout_s}s")

    # ------------------------------------------------------------------------------- outgoing
    def _status(self, peer: _Peer, closing: bool = False) -> bytes:
        a = self._pool.accounts.get(peer.rid)
        cfg = self.config
        st = wire.Status(ch=self.name, inc=self._inc, known=True, closing=closing, cap_m=self._link_m,
                         cap_b=self._link_b, max_msg=cfg.max_message_bytes, lim_m=a.lim_m if a else 0,
                         lim_b=a.lim_b if a else 0, acks=peer.acks, eos_ack=peer.state == "eos",
                         shm_max=peer.shm.max_bytes if peer.shm is not None else 0,
                         freed=self._freed(peer))
        peer.acks, peer.dirty = [], False
        return st.to_bytes()

    def _reply_unknown(self, rid: bytes) -> None:
        """Answer a link we do not know (or gave up on): start a new one (and prove the secret on
        this nonce), at the rate the gate allows; ZeroMQ queues at most sockets.OUTBOX_HWM of them
        towards a link that does not read."""
        if self._gate.may_answer(rid):
            st = wire.Status(ch=self.name, inc=self._inc, known=False, cap_m=self._link_m, cap_b=self._link_b,
                             max_msg=self.config.max_message_bytes, nonce=self._gate.nonce(rid))
            self._outbox.append((rid, st.to_bytes()))

    @staticmethod
    def _freed(peer: _Peer) -> list[str]:
        """Blocks of the producer's shared memory that no batch here refers to any more."""
        out: list[str] = []
        if peer.shm is not None:
            freed = peer.shm.freed
            while freed and len(out) < wire.MAX_FREED:
                out.append(freed.popleft())
        return out

    async def _ack_timer(self) -> None:
        """Send what ack() held back ACK_DELAY_S after it was first held back, unless a flush sent
        it sooner (one task for the channel's life: cheaper than a task per timer)."""
        while True:
            await self._flush_armed.wait()
            self._flush_armed.clear()
            while self._flush_at is not None:
                delay = self._flush_at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)  # a flush meanwhile may clear or move _flush_at
                    continue
                self._flush_at = None
                if self._unflushed and self._state == "bound":
                    self._flush()

    def _flush(self) -> None:
        """Grant free credit and send every status that is owed (acks, limits, heartbeats); again
        if a link was dropped meanwhile (its status found its connection gone: its credit is free)."""
        while True:
            self._unflushed, self._urgent, self._flush_at = 0, False, None
            for rid in self._pool.regrant():
                self._peers[rid].dirty = True
            for peer in self._peers.values():
                if peer.dirty:
                    self._outbox.append((peer.rid, self._status(peer)))
            self._send_outbox()
            if not self._urgent or self._state != "bound":
                return

    def _on_send_error(self, error: Any, frames: list) -> None:
        """A status was not written. EHOSTUNREACH: the link's connection is gone (ZeroMQ dropped its
        pipe), so the link is. Else its queue is full (it does not read): limits and states in it
        are cumulative and go out again with the next one; acknowledgements and released blocks are
        not, so they go back to the link to be sent again."""
        peer = self._peers.get(frames[0])
        if peer is None:
            return
        if getattr(error, "errno", None) == zmq.EHOSTUNREACH:
            return self._drop(peer, "connection closed (process exited or network failed)"
                              if peer.state == "open" else None)
        try:
            st = wire.Status.from_header(wire.unpack_header(frames[1], self._limits))
        except DecodeError:
            return
        peer.acks[:0] = st.acks
        if peer.shm is not None:
            peer.shm.freed.extendleft(reversed(st.freed))
        peer.dirty = True
        log.debug("channel %s: a status to %r was not sent (%s); its acknowledgements wait for the next",
                  self.name, peer.rid[:24], error)

    def _send_outbox(self) -> None:
        out, self._outbox = self._outbox, []
        for rid, payload in out:
            self._pump.send([rid, payload])
        # written now, not corked until the turn of the loop ends: statuses carry credit, and a
        # consumer that works through a drain of batches in one turn would otherwise hand its
        # producers the first quarter of their credit at once and the rest only at its end
        self._pump.flush()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _shutdown(self) -> None:
        for peer in self._peers.values():
            if peer.shm is not None:
                peer.shm.close()
        if self._state in ("new", "bound"):
            self._state = "closing"
            self._work.cancel()
            if self._pump is not None:
                self._pump.close(monitor=self._mon)
                security.release(self._domain)
            if self._endpoint is not None:
                await self._endpoint.cleanup()
        self._state = "closed"
        self._notify()
        await self._work.aclose()
