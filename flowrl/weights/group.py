"""One torch.distributed group per membership epoch, formed from the publisher's store.

Every membership change (a rollout replica restarted or added) is a new epoch: the controller
hands out ranks and each member builds `ProcessGroupGloo` (CPU) or `ProcessGroupNCCL` (GPU) over
the epoch's own store prefix. Nobody else restarts. gloo's sockets bind to `host` (loopback on
one machine), never to whatever the machine's hostname resolves to. Every collective has a
timeout, so a member that dies mid-broadcast becomes an error on the others, never a hang.

    group = WeightGroup.join(epoch=3, rank=1, world_size=3, store=sealed.child("epoch-3"),
                             timeout_s=30, host="127.0.0.1")
    group.broadcast([version, *buckets], on_bucket=...)   # rank 0 sends, the others receive
    group.close()
"""

from __future__ import annotations

import datetime
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable

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


@dataclass
class WeightGroup:
    epoch: int
    rank: int
    world_size: int
    pg: Any
    store: Any
    device: str

    @classmethod
    def join(cls, *, epoch: int, rank: int, world_size: int, store: Any, timeout_s: float = 30.0,
             device: str = "cpu", host: str = "127.0.0.1") -> "WeightGroup":
        """Form the group; blocks until all `world_size` members have called it (or `timeout_s`).

        `store` is the epoch's own store (a `SealedStore.child`); a plain TCPStore or an
        (address, port) pair is put under the prefix `epoch-N` (the runtime's worker does this)."""
        import torch.distributed as dist

        from flowrl.weights.store import client

        timeout = datetime.timedelta(seconds=timeout_s)
        if isinstance(store, tuple):
            store = client(store, timeout_s)
        if not hasattr(store, "child"):
            store = dist.PrefixStore(f"epoch-{epoch}", store)
        try:
            if device.startswith("cuda"):
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
            else:
                opts = dist.ProcessGroupGloo._Options()
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
                opts._timeout = timeout
                pg = dist.ProcessGroupGloo(store, rank, world_size, opts)
        except Exception as e:  # noqa: BLE001 - re-raised with the epoch and rank
            raise WeightSyncError(f"cannot form weight group epoch {epoch} as rank {rank}/{world_size} within "
                                  f"{timeout_s:.0f} s: {e}") from e
        return cls(epoch, rank, world_size, pg, store, device)

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
            raise WeightSyncError(f"weight broadcast (epoch {self.epoch}, rank {self.rank}/{self.world_size}) "
                                  f"failed: {e}") from e
        return time.perf_counter() - t0

    def abort(self) -> None:
        """Ask the backend to break a collective that waits for a dead member. With gloo (torch
        2.13) a receive already waiting is not interrupted: it still ends at `timeout_s`."""
        pg = self.pg
        if pg is not None and hasattr(pg, "abort"):
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - best effort; the timeout still bounds the wait
                pass

    def close(self) -> None:
        self.pg = None
