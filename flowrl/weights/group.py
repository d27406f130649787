"""One torch.distributed group per membership epoch, formed from the publisher's store.

Every membership change (a rollout replica restarted or added) is a new epoch: the controller
hands out ranks and each member builds `ProcessGroupGloo` (CPU) or `ProcessGroupNCCL` (GPU) over
the epoch's own store prefix. Nobody else restarts. gloo's sockets bind to `host` (loopback on
one machine), never to whatever the machine's hostname resolves to. Every collective has a
timeout, so a member that dies mid-broadcast becomes an error on the others, never a hang; and a
member whose broadcast failed shuts its connections down, so the members still waiting on it fail
at once instead of at that timeout (gloo cannot abort a collective under way).

    group = WeightGroup.join(epoch=3, rank=1, world_size=3, store=sealed.child("epoch-3"),
                             timeout_s=30, host="127.0.0.1")
    group.broadcast([version, *buckets], on_bucket=...)   # rank 0 sends, the others receive
    group.close()
"""

from __future__ import annotations

import datetime
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from flowrl.weights.aside import Aside, shut_down, tcp_links
from flowrl.weights.errors import WeightSyncError


def host_store(timeout_s: float = 60.0, host: str = "127.0.0.1") -> Any:
    """A TCPStore server listening on `host` only (the runtime's worker still calls this)."""
    from flowrl.weights.store import WeightStore

    return WeightStore(host, timeout_s=timeout_s).server


def local_address(peer_host: str) -> str:
    """The address of this host's interface that reaches `peer_host` (no packet is sent)."""
    if peer_host.startswith("127.") or peer_host in ("localhost", "::1"):
        return peer_host if peer_host != "localhost" else "127.0.0.1"
    family = socket.getaddrinfo(peer_host, 9, type=socket.SOCK_DGRAM)[0][0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((peer_host, 9))
        return s.getsockname()[0]


FORM_SLICE_S = 0.05
"""How often a gloo group's forming checks its fence. gloo retries a connection to a member that died
after it posted its address for 5 x the group's timeout, a wait that nothing interrupts; a fenced
forming is left to its thread (it touches no weights, and fails at that timeout) and the round ends."""


def opened_since(before: tuple[set, set]) -> frozenset:
    """The connections opened since `before` (tcp_links()): gloo's own pairs. Less those accepted by a
    listener that was there already (a weight store's server, a channel's bind) and those to a
    listener of this process (a client of its own store). A connection another thread opens in the
    same milliseconds (a channel reconnecting over tcp) is counted too: shut down when a broadcast
    fails, its channel reconnects and re-sends what was not acknowledged, as after any network error."""
    links, listening = before
    now, listening_now = tcp_links()
    return frozenset(x for x in now - links if x[1][1] not in listening and x[2][1] not in listening_now)


def _fenced(make: Callable[[], Any], stop: Callable[[], str | None] | None) -> Any:
    """`make()`, aside when there is a fence to hear: left to its thread (and this raises) once
    `stop()` gives a reason."""
    if stop is None:
        return make()
    call = Aside(make, "flowrl-weight-group-form")
    while not call.wait(FORM_SLICE_S):
        why = stop()
        if why:
            raise WeightSyncError(f"left while forming: {why}")
    return call.result()


@dataclass
class WeightGroup:
    epoch: int
    rank: int
    world_size: int
    pg: Any
    store: Any
    device: str
    timeout_s: float = 30.0  # each broadcast's
    links: frozenset = field(default_factory=frozenset)  # gloo: (fd, local, remote) of the connections it opened

    @classmethod
    def join(cls, *, epoch: int, rank: int, world_size: int, store: Any, timeout_s: float = 30.0,
             device: str = "cpu", host: str = "127.0.0.1", stop: Callable[[], str | None] | None = None) -> "WeightGroup":
        """Form the group; blocks until all `world_size` members have called it (or `timeout_s`), or,
        for gloo, until `stop()` gives a reason (a newer epoch was ordered: see FORM_SLICE_S).

        `store` is the epoch's own store (a `SealedStore.child`); a plain TCPStore or an
        (address, port) pair is put under the prefix `epoch-N` (the runtime's worker does this)."""
        import torch.distributed as dist

        from flowrl.weights.store import client

        timeout = datetime.timedelta(seconds=timeout_s)
        if isinstance(store, tuple):
            store = client(store, timeout_s)
        if not hasattr(store, "child"):
            store = dist.PrefixStore(f"epoch-{epoch}", store)
        before = None if device.startswith("cuda") else tcp_links()
        try:
            if device.startswith("cuda"):
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
            else:
                opts = dist.ProcessGroupGloo._Options()
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
                opts._timeout = timeout
                pg = _fenced(lambda: dist.ProcessGroupGloo(store, rank, world_size, opts), stop)
        except Exception as e:  # noqa: BLE001 - re-raised with the epoch and rank
            raise WeightSyncError(f"cannot form weight group epoch {epoch} as rank {rank}/{world_size} within "
                                  f"{timeout_s:.0f} s: {e}") from e
        links = frozenset() if before is None else opened_since(before)
        return cls(epoch, rank, world_size, pg, store, device, timeout_s, links)

    def check_layout(self, digest: str, timeout_s: float = 30.0) -> None:
        """Rank 0 posts its layout digest; the others compare (the runtime's worker still calls this;
        `WeightSubscriber` checks whole layouts, naming the tensor)."""
        if self.rank == 0:
            self.store.set("layout", digest)
            return
        theirs = self.store.get("layout").decode()
        if theirs != digest:
            raise WeightSyncError(
                f"weight layout differs from the publisher's (digest {theirs} vs ours {digest}): the "
                "rollout and actor must build the same model architecture")

    def broadcast(self, tensors: list, fill: Callable[[int], None] | None = None,
                  drain: Callable[[int], None] | None = None,
                  on_bucket: Callable[[int], None] | None = None) -> float:
        """Broadcast every tensor from rank 0, in order; returns seconds spent.

        Rank 0 calls `fill(i)` just before tensor i goes out (while i-1 is on the wire); the others
        call `drain(i)` as soon as tensor i has arrived. `on_bucket(i)` runs on every rank after
        tensor i is done (a test's fault hook)."""
        import torch.distributed as dist

        t0 = time.perf_counter()
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            works = []
            for i, t in enumerate(tensors):
                if fill is not None and self.rank == 0:
                    fill(i)
                works.append(self.pg.broadcast([t], opts))
            for i, work in enumerate(works):
                work.wait()
                if drain is not None and self.rank != 0:
                    drain(i)
                if on_bucket is not None:
                    on_bucket(i)
        except Exception as e:  # noqa: BLE001
            self.break_links()  # who still waits on this member fails now, not at its timeout
            raise WeightSyncError(f"weight broadcast (epoch {self.epoch}, rank {self.rank}/{self.world_size}) "
                                  f"failed: {e}") from e
        return time.perf_counter() - t0

    def break_links(self) -> None:
        """Shut down the TCP connections the group opened (gloo). A member that died mid-broadcast
        fails its direct peers at once; the others would wait for data from those peers until the
        collective's timeout (30 s and more): neither `abort()` nor `shutdown()` nor dropping the
        process group closes gloo's connections (torch 2.13). Shut down under gloo, its pending
        operations fail at once and the failure reaches every member."""
        shut_down(self.links)

    def abort(self) -> None:
        """Break a collective that waits for a dead member: NCCL's abort; with gloo, whose abort
        does not interrupt a receive already waiting (torch 2.13), the group's connections."""
        self.break_links()
        pg = self.pg
        if pg is not None and hasattr(pg, "abort"):
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - best effort; the timeout still bounds the wait
                pass

    def close(self) -> None:
        self.pg = None
