"""Weight-sync groups: one torch.distributed group per membership epoch, from a fresh store prefix.

The publisher (trainer rank 0) hosts a TCPStore for the whole run; every membership change (a
rollout replica restarted or added) is a new epoch: the controller hands out ranks, and each
member builds `ProcessGroupGloo` (CPU) or `ProcessGroupNCCL` (GPU) over `PrefixStore("epoch-N")`.
Nobody else restarts. Every collective has a timeout, so a member that dies mid-broadcast turns
into an error on the others, never a hang.

    group = WeightGroup.join(epoch=3, rank=1, world_size=3, store=("127.0.0.1", port), timeout_s=30)
    group.broadcast(buckets)          # rank 0 sends, the others receive in place
    group.close()
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Any


def host_store(timeout_s: float = 60.0) -> Any:
    """Start the publisher's TCPStore server on a free loopback port; `.port` tells which."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, None, is_master=True,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


class WeightSyncError(RuntimeError):
    """A weight broadcast failed (peer died, timeout, layout mismatch)."""


@dataclass
class WeightGroup:
    epoch: int
    rank: int
    world_size: int
    pg: Any
    store: Any
    device: str

    @classmethod
    def join(cls, *, epoch: int, rank: int, world_size: int, store: Any | tuple[str, int],
             timeout_s: float = 30.0, device: str = "cpu") -> "WeightGroup":
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        if isinstance(store, tuple):
            store = dist.TCPStore(store[0], store[1], None, is_master=False, timeout=timeout)
        prefixed = dist.PrefixStore(f"epoch-{epoch}", store)
        try:
            if device.startswith("cuda"):
                pg = dist.ProcessGroupNCCL(prefixed, rank, world_size)
            else:
                pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        except Exception as e:  # noqa: BLE001 - re-raised with the epoch and rank
            raise WeightSyncError(f"cannot form weight group epoch {epoch} as rank {rank}/{world_size}: {e}") from e
        return cls(epoch, rank, world_size, pg, store, device)

    def check_layout(self, digest: str, timeout_s: float = 30.0) -> None:
        """Rank 0 posts its layout digest; the others compare, so a model mismatch is a clear error."""
        key = f"epoch-{self.epoch}/layout"
        if self.rank == 0:
            self.store.set(key, digest)
            return
        theirs = self.store.get(key).decode()
        if theirs != digest:
            raise WeightSyncError(
                f"weight layout differs from the publisher's (digest {theirs} vs ours {digest}): the "
                "rollout and actor must build the same model architecture")

    def broadcast(self, buckets: list, fill=None, drain=None) -> float:
        """Broadcast every bucket from rank 0; returns seconds spent.

        Pipelined: rank 0 calls `fill(i)` (pack bucket i) just before bucket i goes out, while
        bucket i-1 is still on the wire; receivers call `drain(i)` (copy bucket i out) as soon as
        bucket i has arrived, while later ones are still coming.
        """
        import torch.distributed as dist

        t0 = time.perf_counter()
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        try:
            works = []
            for i, b in enumerate(buckets):
                if fill is not None and self.rank == 0:
                    fill(i)
                works.append(self.pg.broadcast([b], opts))
            for i, work in enumerate(works):
                work.wait()
                if drain is not None and self.rank != 0:
                    drain(i)
        except Exception as e:  # noqa: BLE001
            raise WeightSyncError(f"weight broadcast (epoch {self.epoch}, rank {self.rank}/{self.world_size}) failed: {e}") from e
        return time.perf_counter() - t0

    def abort(self) -> None:
        """Break a collective that waits for a dead member (it raises instead of timing out)."""
        pg = self.pg
        if pg is not None and hasattr(pg, "abort"):
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - best effort; the timeout still bounds the wait
                pass

    def close(self) -> None:
        self.pg = None
