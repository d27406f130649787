"""A node process's side of fault injection: the faults it does to itself (the spec language:
flowrl/runtime/protocol/faults.py)."""

from __future__ import annotations

import os
import signal

import anyio

from flowrl.runtime.protocol.faults import Fault, parse_faults


class FaultInjector:
    """The faults of one node process. Hooks are no-ops when no fault targets this process."""

    def __init__(self, specs: list[str], node: str, replica: int, rank: int = 0):
        self.faults = [f for f in parse_faults(specs) if f.targets(node, replica, rank)]
        self.sent = 0
        self.armed = False

    def arm(self, incarnation: int) -> None:
        self.faults = [f for f in self.faults if f.every or incarnation == 0]
        self.armed = True

    def check_setup(self) -> None:
        if any(f.action == "crash" for f in self.faults):
            raise RuntimeError("injected crash in setup (fault 'crash')")

    def _due(self, action: str, step: int) -> Fault | None:
        for f in self.faults:
            if f.action == action and not f.fired and f.step is not None and f.step == step:
                f.fired = True
                return f
        return None

    async def on_batch(self, step: int) -> None:
        if not self.faults:
            return
        if self._due("kill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._due("hang", step):
            os.kill(os.getpid(), signal.SIGSTOP)
        for f in self.faults:
            if f.action == "slow":
                await anyio.sleep(f.seconds)

    def stall(self, step: int) -> float:
        """Seconds the call of `step` wedges its compute thread for (0: none); the event loop and the
        heartbeat thread go on, so only `process_timeout_s` finds it."""
        f = self._due("stall", step) if self.faults else None
        return (f.seconds or 1e6) if f else 0.0

    async def on_send(self, addresses: list[str], batch) -> bool:
        """Returns True when the message must not be sent (dropped or replaced by garbage)."""
        if not self.faults:
            return False
        step, self.sent = self.sent, self.sent + 1
        await self.hold()
        if self._due("drop", step):
            return True
        if self._due("corrupt", step):
            await send_garbage(addresses)  # garbled frames reach the consumer first; it must reject them
        return False

    async def hold(self) -> None:
        """`delay` faults: hold an outgoing message (an output, a rank's shard or answer) `seconds`."""
        for f in self.faults:
            if f.action == "delay":
                await anyio.sleep(f.seconds)

    def forged(self, batch):
        """A batch to send before `batch` (its next message), or None."""
        if not self.faults or not self._due("forge", self.sent):
            return None
        import numpy as np

        from flowrl.transport import Batch

        return Batch(tensors={"forged": np.zeros(3, dtype=np.int64)}, batch_id=batch.batch_id, attempt=batch.attempt,
                     index=batch.index + 1, min_version=batch.min_version, epoch=batch.epoch)

    def on_checkpoint(self, step: int) -> None:
        for f in self.faults:
            if f.action == "kill" and not f.fired and f.checkpoint == step:
                f.fired = True
                os.kill(os.getpid(), signal.SIGKILL)

    def on_request(self, n: int) -> None:
        """A service request (the `n`-th, 0-based) taken by a server or sent by a client."""
        for f in self.faults:
            if f.request == n and not f.fired and f.action in ("kill", "hang"):
                f.fired = True
                os.kill(os.getpid(), signal.SIGKILL if f.action == "kill" else signal.SIGSTOP)

    def fail_sync(self, version: int) -> bool:
        for f in self.faults:
            if f.action == "fail_sync" and not f.fired and f.version == version:
                f.fired = True
                return True
        return False

    async def timer_loop(self) -> None:
        timed = sorted((f for f in self.faults if f.t is not None and f.action in ("kill", "hang")), key=lambda f: f.t)
        elapsed = 0.0
        for f in timed:
            await anyio.sleep(max(0.0, f.t - elapsed))
            elapsed = f.t
            os.kill(os.getpid(), signal.SIGKILL if f.action == "kill" else signal.SIGSTOP)


async def send_garbage(addresses: list[str]) -> None:
    """Send frames that are not a valid message to every consumer address from a foreign socket."""
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context.instance()
    for address in addresses:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 500)
        sock.connect(address)
        await sock.send_multipart([b"\x93\xff\x00garbage", os.urandom(64)])
        sock.close()
