"""`Sender`: the producer end of a channel. It connects to one or more consumer replicas.

    async with Sender(ChannelConfig(), name="rollout->reward") as tx:
        await tx.connect(address)          # once per consumer replica
        await tx.send(batch)               # waits for credit; goes to a replica that has some
        await tx.end_of_stream()           # waits until everything sent is acknowledged

Its background work (heartbeats, re-sends, closing a lost link's shared memory later) runs in a task
group: the one `async with` opens, or `Sender(..., task_group=tg)` for an owner that has one (a node
process); then `await tx.aclose()` ends it. See tasks.py.

Every sent batch is held until its consumer acknowledges it. When a consumer is lost — its
connection closes (ipc/tcp: process exited, or ZeroMQ's heartbeat gave up on a frozen host), it
comes back as a new incarnation at the same address, it says it is closing, or (inproc only) its
heartbeats stop — everything it had not acknowledged is re-sent, oldest first, to a live replica
(the restarted one or another). If no replica is live for `peer_timeout_s`, those batches are
handed back (`take_returned()`) and `send()` raises BrokenChannel instead of waiting forever.

Delivery is at-least-once: a consumer that was only cut off (not dead) may also process a batch that
was re-sent elsewhere; joins and sinks drop duplicates by `batch_id`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

import anyio
import zmq
from anyio.abc import TaskGroup
from zmq.utils.monitor import parse_monitor_message

from flowrl.transport import codec, security, shm, sockets, wire
from flowrl.transport.batch import Batch
from flowrl.transport.config import ChannelConfig, CurveConfig
from flowrl.transport.endpoints import scheme_of
from flowrl.transport.pick import endpoint_for
from flowrl.transport.errors import BrokenChannel, ChannelClosed, DecodeError
from flowrl.transport.link import ENV_ALLOWANCE, Entry, Link
from flowrl.transport.stats import ChannelStats
from flowrl.transport.tasks import ChannelTasks, TaskOwner

log = logging.getLogger("flowrl.transport")
SHM_HEADER_ALLOWANCE = 64  # bytes a shared-memory reference [id, fd, used] adds to a header, at most
SHM_DESC_ALLOWANCE = 8  # ... and a tensor's `at` as a block offset (up to 9 bytes) over a frame index (1)
SHM_WAIT_S = 0.05  # how long a batch waits for a shared-memory block to come back


class Sender(TaskOwner):
    """Producer end of one channel; see the module docstring."""

    def __init__(self, config: ChannelConfig | None = None, *, name: str = "channel",
                 task_group: TaskGroup | None = None):
        """`task_group`: where the channel's background work runs (it must outlive the channel:
        `aclose()` it first); without one, use the Sender as `async with`, which opens one."""
        self.config = config or ChannelConfig()
        self.name = name
        self._id = secrets.token_hex(6)
        self._secret = None if self.config.secret is None else self.config.secret.get_secret_value()
        self._links: dict[str, Link] = {}
        self._picks = 0  # transmits so far: Link.picked
        self._curves: dict = {}  # address -> CurveConfig of that replica (replicas on other hosts have their own keys)
        self._seq = 0
        self._pending: dict[int, Entry] = {}   # waiting to be re-sent, by sequence number
        self._returned: list[Batch] = []
        self._order = asyncio.Lock()            # one send at a time: order per producer
        self._waiters: list[asyncio.Future] = []  # of _wait_change calls, woken by _notify
        self._state = "open"                    # open | eos | closed
        self._dead_since: float | None = time.monotonic()
        self._cause = "no consumer has answered yet"
        self._work = ChannelTasks(f"sender {name!r}", task_group)
        self._ticking = False
        self._resending = False
        self._lingering: list = []  # shared memory of lost links, kept open a while (see _close_link)
        self._c = dict(sent=0, sent_bytes=0, acked=0, resent=0, returned=0, rejected=0, peers_lost=0,
                       credit_waits=0, credit_wait_s=0.0, shm=0, shm_bytes=0)
        self._inline_max, self._shm_min = self.config.inline_max_bytes, self.config.shm_min_bytes  # read per batch

    # ------------------------------------------------------------------------------- public API
    async def connect(self, address: str, *, wait: bool = True, curve: CurveConfig | None = None) -> None:
        """Add the consumer replica at `address`. With `wait`, return once it answered (at most
        `peer_timeout_s`, else BrokenChannel). `curve`: this replica's CURVE keys (its own server
        key; default `config.curve`), for a channel whose replicas run on several hosts."""
        self._check_open()
        if address in self._links:
            raise ValueError(f"sender {self.name!r} is already connected to {address}")
        if curve is not None:
            self._curves[address] = curve
        endpoint_for(address, self.config.model_copy(update={"curve": self._curve(address)}), self.name).check_connect(address)
        await self._work.start()
        self._open_link(address, 0)
        if not self._ticking:
            self._ticking = self._work.spawn(self._tick_loop)
        if wait:
            with anyio.move_on_after(self.config.peer_timeout_s):
                while not self._links[address].live:
                    await self._wait_change(self.config.heartbeat_s)
            if not self._links[address].live:
                refused = self._links[address].refused
                await self.disconnect(address)
                raise BrokenChannel(f"no consumer of channel {self.name!r} answered at {address} within "
                                    f"{self.config.peer_timeout_s}s ({refused or 'not bound yet? wrong address or keys?'})")

    async def disconnect(self, address: str) -> list[Batch]:
        """Stop using the replica at `address`; returns what was sent there and not acknowledged."""
        link = self._links.pop(address, None)
        self._curves.pop(address, None)
        if link is None:
            raise ValueError(f"sender {self.name!r} is not connected to {address}")
        entries = sorted(link.unacked.values(), key=lambda e: e.seq)
        link.unacked.clear()
        self._close_link(link, "bye")
        self._update_liveness()
        return [e.batch for e in entries]

    async def send(self, batch: Batch) -> None:
        """Send `batch` to a replica with credit, waiting for credit if needed (never dropping).
        Raises BrokenChannel when no replica was live for `peer_timeout_s` (the batch stays yours),
        ValueError when it is larger than the consumer accepts, ChannelClosed after
        `end_of_stream()` / `aclose()`."""
        if type(batch) is not Batch and not isinstance(batch, Batch):
            raise TypeError(f"send() takes a Batch, got {type(batch).__name__}")
        if self._state != "open":
            self._check_open()
        prepared = codec.prepare(batch, self._inline_max)
        entry = None
        if not self._pending and not self._order.locked():
            # nothing is queued ahead: if a link has credit, send without awaiting (order is kept)
            self._seq += 1
            entry = Entry(self._seq, prepared)
            link, frames, size, _ = self._pick(entry)
            if link is not None:
                return self._transmit(link, entry, frames, size, False)
        async with self._order:
            self._check_open()
            if self._pending:
                await self._drain_pending()
            if entry is None:
                self._seq += 1
                entry = Entry(self._seq, prepared)
            if not await self._place(entry, resend=False):
                raise BrokenChannel(f"channel {self.name!r}: no consumer replica for {self.config.peer_timeout_s}s; "
                                    f"last: {self._cause}")

    def unacked(self) -> list[Batch]:
        """Batches sent and not yet acknowledged, or waiting to be re-sent, oldest first."""
        entries = [e for link in self._links.values() for e in link.unacked.values()] + list(self._pending.values())
        return [e.batch for e in sorted(entries, key=lambda e: e.seq)]

    def take_returned(self) -> list[Batch]:
        """Batches no replica could take in time (handed back); the list is emptied."""
        out, self._returned = self._returned, []
        return out

    async def end_of_stream(self) -> None:
        """Finish the stream: waits until every sent batch is acknowledged (or handed back), then
        tells every live replica, waiting (at most `peer_timeout_s`) for their confirmation."""
        self._check_open()
        self._state = "eos"
        async with self._order:
            while True:
                if self._pending:
                    await self._drain_pending()
                    continue
                if not any(link.unacked for link in self._links.values()):
                    break
                await self._wait_change(self.config.heartbeat_s)
        for link in self._links.values():
            self._send_hello(link)
        with anyio.move_on_after(self.config.peer_timeout_s):
            while not all(link.eos_acked for link in self._links.values() if link.live):
                await self._wait_change(self.config.heartbeat_s)

    def statistics(self) -> ChannelStats:
        live = [link for link in self._links.values() if link.live]
        unacked = [e for link in self._links.values() for e in link.unacked.values()]
        return ChannelStats(
            name=self.name, role="sender", peers=len(live),
            in_flight=len(unacked) + len(self._pending),
            in_flight_bytes=sum(e.size for e in unacked) + sum(e.size for e in self._pending.values()),
            queued=len(self._pending), queued_bytes=sum(e.size for e in self._pending.values()),
            credit_messages=sum(max(0, link.avail_m) for link in live),
            credit_bytes=sum(max(0, link.avail_b) for link in live), **self._c)

    async def aclose(self) -> None:
        """Close every link; what was not acknowledged is handed back (`take_returned()`). When it
        returns, no background task of the channel runs any more."""
        if self._state == "closed":
            return await self._work.aclose()
        self._state = "closed"
        self._work.cancel()
        self._cause = f"sender {self.name!r} closed before they were acknowledged"
        self._return(self.unacked())
        self._pending.clear()
        for link in self._links.values():
            link.unacked.clear()
            self._close_link(link, "bye")
        for arena in self._lingering:
            arena.close()
        self._notify()
        await self._work.aclose()


    # ------------------------------------------------------------------------------- placing
    async def _place(self, entry: Entry, resend: bool) -> bool:
        """Transmit `entry` on a live link with credit, waiting as long as some link is live."""
        t0 = None
        while True:
            self._check_open(allow_eos=True)
            if resend and entry.seq not in self._pending:
                return False
            link, frames, size, fits = self._pick(entry)
            if link is not None:
                self._transmit(link, entry, frames, size, resend)
                if t0 is not None:
                    self._c["credit_wait_s"] += time.monotonic() - t0
                return True
            if not fits:
                limits = ", ".join(f"{a}: {lk.cap_b} B capacity / {lk.max_msg} B max message"
                                   for a, lk in self._links.items() if lk.live)
                raise ValueError(f"batch {entry.batch.batch_id!r} is a {size}-byte message; the "
                                 f"consumers accept less ({limits}); split it (Batch.split) or raise "
                                 "capacity_bytes / max_message_bytes")
            if self._broken():
                return False
            if t0 is None:
                t0 = time.monotonic()
                self._c["credit_waits"] += 0 if resend else 1
            for lk in self._links.values():
                if lk.live and lk.need != size:
                    lk.need, lk.idle = size, False
                    self._send_hello(lk)
            waits = [SHM_WAIT_S - (time.monotonic() - lk.shm_wait) for lk in self._links.values()
                     if lk.shm_wait is not None]
            await self._wait_change(max(0.001, min([self.config.heartbeat_s, *waits])))

    def _pick(self, entry: Entry) -> tuple[Link | None, list | None, int, bool]:
        """The least loaded live link with credit for `entry`: (link, frames, size, fits anywhere)."""
        links = self._links
        if len(links) == 1:
            (lk,) = links.values()
            live = (lk,) if lk.live else ()
        else:
            # least loaded; among equals the one chosen longest ago, so an idle replica added by
            # `flowrl scale` is not passed over while the first one keeps up
            live = sorted((lk for lk in links.values() if lk.live), key=lambda lk: (len(lk.unacked), lk.picked))
        fits = not live
        size = entry.size
        prepared = entry.prepared
        if prepared is None:  # written before (and not acknowledged): a re-send prepares it again
            prepared = entry.prepared = codec.prepare(entry.batch, self._inline_max)
        for lk in live:
            env = [lk.inc, lk.sent_m + 1]  # sequence numbers count a link's messages
            frames = prepared.frames(env)
            size = entry.size = len(frames[0]) + prepared.payload_bytes
            if size > lk.cap_b or size > lk.max_msg:
                continue
            fits = True
            shm_size = self._shm_bound(lk, prepared, len(frames[0])) if prepared.payload_bytes >= self._shm_min else 0
            need = shm_size or size
            if lk.lim_m - lk.sent_m - lk.ret_m >= 1 and lk.lim_b - lk.sent_b - lk.ret_b >= need:  # avail_m, avail_b
                if shm_size:
                    ref = lk.arena.put(prepared.buffers)
                    if ref is not None:
                        lk.shm_wait = None
                        self._c["shm"] += 1
                        self._c["shm_bytes"] += ref[2]
                        head = prepared.shm_header(env, list(ref[:3]), ref[3])
                        return lk, [head], len(head) + ref[2], True
                    if self._wait_for_block(lk):
                        continue
                return lk, frames, size, True
            if lk.idle and not lk.need and len(links) > 1:  # it handed its credit back while another
                lk.idle = False  # replica kept up: ask for some again, or it is passed over for good
                self._send_hello(lk)
            size = need
        if not size:  # no live link yet: size without envelope, plus room for it
            size = len(prepared.frames()[0]) + ENV_ALLOWANCE + prepared.payload_bytes
        return None, None, size, fits

    def _shm_bound(self, link: Link, prepared: codec.Prepared, head_bytes: int) -> int:
        """An upper bound on the credit size of `prepared` sent through `link`'s shared memory (its
        header grows by the reference and by up to SHM_DESC_ALLOWANCE per tensor; the tensors are
        padded to ALIGN), or 0 when it goes over the socket (small, no shared memory, starved, or
        its shared-memory form would not fit where its socket form does)."""
        if not link.shm_ok or link.shm_starved or prepared.payload_bytes < self.config.shm_min_bytes:
            return 0
        bound = (head_bytes + SHM_HEADER_ALLOWANCE + SHM_DESC_ALLOWANCE * len(prepared.buffers)
                 + shm.layout([b.nbytes for b in prepared.buffers])[1])
        return bound if bound <= link.cap_b and bound <= link.max_msg else 0

    @staticmethod
    def _wait_for_block(link: Link) -> bool:
        """No block of `link` can take a batch: wait for a lent one to come back (True), unless
        waiting has lasted SHM_WAIT_S (the consumer holds on to its batches: use the socket until it
        frees one) or none is lent (False: this batch goes over the socket)."""
        if not link.arena.lent:  # nothing to wait for: this batch is too big for the arena (or the OS said no)
            return False
        now = time.monotonic()
        if link.shm_wait is None:
            link.shm_wait = now
        if now - link.shm_wait < SHM_WAIT_S:
            return True
        link.shm_starved, link.shm_wait = True, None
        return False

    def _transmit(self, link: Link, entry: Entry, frames: list, size: int, resend: bool) -> None:
        """Hand `entry` to `link`. From here the channel owns it: if the write fails, losing the
        link moves it (with the link's other unacknowledged entries) back to pending."""
        if resend:
            self._pending.pop(entry.seq, None)
            self._c["resent"] += 1
        link.sent_m += 1
        self._picks += 1
        link.picked = self._picks
        link.unacked[link.sent_m] = entry  # acknowledged by the link's sequence number (_pick)
        link.sent_b += size
        link.used = True
        if link.need:
            for lk in self._links.values():  # no longer waiting; the next hellos say so
                lk.need = 0
        c = self._c
        c["sent"] += 1
        c["sent_bytes"] += size
        entry.prepared = None  # the frames are written (or corked): only the batch is held from here
        link.pump.send(frames)

    async def _drain_pending(self) -> None:
        """Re-send pending entries oldest first (caller holds the order lock)."""
        while self._pending:
            seq = min(self._pending)
            try:
                placed = await self._place(self._pending[seq], resend=True)
            except ValueError as e:  # the replicas left accept less than this batch needs
                log.warning("channel %s: %s", self.name, e)
                self._return([self._pending.pop(seq).batch])
                continue
            if not placed:
                self._return([e.batch for _, e in sorted(self._pending.items())])
                self._pending.clear()

    async def _resend_task(self) -> None:
        try:
            async with self._order:
                if self._state != "closed":
                    await self._drain_pending()
        except ChannelClosed:
            pass  # closed meanwhile: aclose() hands everything back
        finally:
            self._resending = False

    def _return(self, batches: list[Batch]) -> None:
        if batches:
            self._returned.extend(batches)
            self._c["returned"] += len(batches)
            log.warning("channel %s: %d batch(es) handed back undelivered (%s)", self.name, len(batches), self._cause)

    # ------------------------------------------------------------------------------- links
    def _open_link(self, address: str, epoch: int) -> Link:
        rid = f"{self._id}.{epoch}".encode()
        sock = sockets.dealer(self.config, rid)
        security.apply_client(sock, self._curve(address))
        mon = None if scheme_of(address) == "inproc" else sockets.monitor(sock, zmq.EVENT_DISCONNECTED)
        sock.connect(address)
        link = self._links[address] = Link(address, epoch, rid)
        if scheme_of(address) == "ipc" and self.config.shm_bytes:
            link.arena = shm.ShmArena(self.config.shm_bytes, label=f"flowrl-{self.name}"[:200],
                                      window_bytes=self.config.shm_window_bytes)
        link.mon = None if mon is None else sockets.Pump(mon, lambda msgs: self._on_monitor(link, msgs), copy=True)
        link.pump = sockets.Pump(sock, lambda msgs: self._on_messages(link, msgs), copy=True, bundle=True)
        link.pump.on_send_error = lambda e, frames: self._on_send_error(link, e)
        self._send_hello(link)
        return link

    def _curve(self, address: str) -> CurveConfig | None:
        return self._curves.get(address, self.config.curve)

    def _close_link(self, link: Link, state: str, gone: bool = False) -> None:
        """`gone`: its connection closed. Then nothing more is written and nothing queued is kept:
        a socket closed with linger reconnects meanwhile, and would hand what it still holds (a
        hello, batches of a link given up on) to whatever now listens at the address, a restarted
        consumer that never knew this link."""
        if link.dead:
            return
        link.dead, link.live = True, False
        if gone:
            link.pump.out_clear()
        else:
            self._send_hello(link, state)
        link.pump.close(linger_ms=0 if gone else 100, monitor=link.mon)
        link.pump.handler = link.pump.on_send_error = None  # no cycle through the link outlives it
        if link.mon is not None:
            link.mon.handler = None
        if link.arena is not None:
            # what the consumer mapped stays valid for it; what it has not mapped yet (batches still
            # on their way when we leave) must stay open a while, or they would reach it unmappable
            if self._state != "closed" and self._work.spawn(self._close_later, link.arena):
                self._lingering.append(link.arena)
            else:
                link.arena.close()

    async def _close_later(self, arena: shm.ShmArena) -> None:
        """Close a lost link's shared memory once its last batches had time to be mapped (aclose()
        closes it sooner)."""
        await anyio.sleep(self.config.peer_timeout_s)
        arena.close()
        self._lingering.remove(arena)

    def _lose(self, link: Link, cause: str, gone: bool = False) -> None:
        """Give up on a link: its unacknowledged entries wait for re-sending; a new link (a new
        socket, a new routing id) to the same address replaces it. `gone`: its connection closed."""
        if link.dead:
            return
        self._c["peers_lost"] += 1
        self._cause = cause
        log.warning("channel %s: %s; %d unacknowledged batch(es) will be re-sent", self.name, cause, len(link.unacked))
        for entry in link.unacked.values():
            self._pending[entry.seq] = entry
        link.unacked.clear()
        self._close_link(link, "relink", gone)
        if self._state != "closed" and self._links.get(link.address) is link:
            self._open_link(link.address, link.epoch + 1)
        self._update_liveness()
        if self._pending and not self._resending:
            self._resending = self._work.spawn(self._resend_task)

    def _send_hello(self, link: Link, state: str | None = None) -> None:
        # "eos" only once nothing waits to be (re-)sent or acknowledged: a consumer gives a link that
        # said it no credit, and a link that replaced a lost one during end_of_stream() must get
        # credit for the batches it re-sends
        state = state or ("eos" if self._state == "eos" and not self._pending
                          and not any(lk.unacked for lk in self._links.values()) else "open")
        probe = None
        if link.arena is not None and not link.dead and not link.shm_ok:
            try:
                probe = link.arena.probe()
            except (shm.ShmError, OSError) as e:  # e.g. out of descriptors: the socket path still works
                log.warning("channel %s: no shared memory towards %s (%s)", self.name, link.address, e)
                link.arena.close()
                link.arena = None
        hello = wire.Hello(ch=self.name, state=state, need=link.need, idle=link.idle,
                           ret_m=link.ret_m, ret_b=link.ret_b, shm=probe, mac=link.proof, inc=link.inc)
        link.pump.send([hello.to_bytes()])

    def _on_send_error(self, link: Link, error: zmq.ZMQError) -> None:
        if link.inc is None or link.dead:  # not connected yet (inproc before bind): hellos retry
            log.debug("channel %s: write to %s failed: %s", self.name, link.address, error)
        else:
            self._lose(link, f"writing to consumer at {link.address} failed ({error})", gone=True)

    def _on_messages(self, link: Link, msgs: list) -> None:
        limits = wire.DecodeLimits(max_header_bytes=sockets.CONTROL_MAX_BYTES)
        for frames in msgs:
            if link.dead:
                return
            try:
                if len(frames) != 1:
                    raise DecodeError("bad_frames", f"a status has 1 frame, got {len(frames)}")
                header = wire.unpack_header(frames[0], limits)
                if type(header) is not dict or header["kind"] != wire.STATUS:
                    raise DecodeError("bad_kind", "a consumer sent a message other than a status")
                self._on_status(link, wire.Status.from_header(header))
            except DecodeError as e:
                self._c["rejected"] += 1
                log.warning("channel %s: bad message from consumer at %s: %s", self.name, link.address, e)
            except Exception:  # noqa: BLE001 - a bug must not kill the channel; it is logged
                log.exception("channel %s: internal error on a status from %s", self.name, link.address)
        self._update_liveness()
        self._notify()

    def _on_status(self, link: Link, st: wire.Status) -> None:
        if link.inc is None:
            if not st.known:
                if st.nonce is not None and self._secret is None:
                    link.refused = ("the consumer requires the channel secret and this producer has none; give "
                                    "both ends the same ChannelConfig.secret")
                elif st.nonce is not None and link.proof is not None:
                    link.refused = ("the consumer refused this producer's proof of the channel secret; the two "
                                    "ends have different secrets")
                elif st.nonce is not None and self._secret is not None:
                    link.proof = security.proof(self._secret, st.nonce, link.rid)  # the secret stays here
                    self._send_hello(link)
                return  # else a reply to stale traffic; our hello will be answered
            link.inc, link.live = st.inc, True
        elif st.inc != link.inc:
            return self._lose(link, f"consumer at {link.address} restarted (incarnation {link.inc} -> {st.inc})")
        elif not st.known:
            return self._lose(link, f"consumer at {link.address} had given up on this producer")
        link.last_heard = time.monotonic()
        link.cap_m, link.cap_b, link.max_msg = st.cap_m, st.cap_b, st.max_msg
        link.pump.bundle_max = min(sockets.BUNDLE_BYTES, st.max_msg)  # a bundle must fit where its parts do
        link.lim_m, link.lim_b = max(link.lim_m, st.lim_m), max(link.lim_b, st.lim_b)
        unacked = link.unacked
        held, pop = len(unacked), unacked.pop
        for seq in st.acks:  # (one per batch: a bare pop, counted once after)
            pop(seq, None)
        self._c["acked"] += held - len(unacked)
        link.eos_acked = st.eos_ack
        if link.arena is not None:
            link.shm_ok = st.shm_max > 0
            link.arena.budget_bytes = min(self.config.shm_bytes, st.shm_max)  # what the consumer can map
            for block_id in st.freed:
                link.arena.free(block_id)
            if st.freed:
                link.shm_starved = False
        if st.closing:  # after its last acknowledgements: what is left goes elsewhere
            self._lose(link, f"consumer at {link.address} closed the channel")

    def _on_monitor(self, link: Link, msgs: list) -> None:
        for frames in msgs:
            event = parse_monitor_message(frames)
            if event["event"] == zmq.EVENT_DISCONNECTED and link.inc is not None:
                self._lose(link, f"connection to consumer at {link.address} closed (process exited or "
                                 "network failed)", gone=True)
                return

    async def _tick_loop(self) -> None:
        await sockets.tick_loop(self.config.heartbeat_s, self._tick, self.name, lambda: self._state != "closed")

    def _tick(self, now: float, stalled: bool) -> None:
        for link in list(self._links.values()):
            if link.dead:
                continue
            silent = now - link.last_heard
            if link.mon is None and link.live and not stalled and silent > self.config.peer_timeout_s:
                self._lose(link, f"consumer at {link.address} sent no status for {silent:.1f}s")
                continue
            if link.live and not link.used and not link.need and (not self._order.locked() or self._state == "eos"):
                link.give_back_credit()  # idle: hand unused credit back so others can use it
            elif link.live and not link.used and link.need:
                # blocked, and nothing sent since the last tick: what it holds goes back too, and the
                # consumer grants all it lacks at once. Kept, two links could each hold what the other
                # waits for (one the bytes without a message, the other a message without the bytes).
                link.release_unused()
            link.used = False
            self._send_hello(link)
        self._update_liveness()
        self._notify()

    # ------------------------------------------------------------------------------- helpers
    def _check_open(self, allow_eos: bool = False) -> None:
        if self._state == "closed":
            raise ChannelClosed(f"sender {self.name!r} is closed")
        if self._state == "eos" and not allow_eos:
            raise ChannelClosed(f"sender {self.name!r}: end_of_stream() was called; nothing more can be sent")

    def _update_liveness(self) -> None:
        if any(link.live for link in self._links.values()):
            self._dead_since = None
        elif self._dead_since is None:
            self._dead_since = time.monotonic()

    def _broken(self) -> bool:
        return self._dead_since is not None and time.monotonic() - self._dead_since >= self.config.peer_timeout_s

    def _notify(self) -> None:
        """Something changed: wake every `_wait_change`."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            _wake(waiter)

    async def _wait_change(self, timeout: float) -> None:
        # a future of its own and a timer that wakes it alone, not a cancel scope: a producer that
        # outruns its consumer waits for credit once per burst, and a scope costs it twice what
        # the wait does
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._waiters.append(waiter)
        timer = loop.call_later(timeout, _wake, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            if waiter.cancelled() and waiter in self._waiters:  # its caller was cancelled
                self._waiters.remove(waiter)


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
