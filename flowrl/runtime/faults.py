"""Fault injection: named faults that a node process does to itself, for chaos tests.

Spec language (`flowrl run --fault SPEC`, repeatable; or `faults:` in a graph file)::

    ACTION:NODE[/REPLICA[/RANK]][@WHEN][,OPTION...]

    kill:rollout@step=3        SIGKILL itself before its 4th batch (0-based step 3)
    kill:critic@t=2.5          SIGKILL itself 2.5 s after it reported READY
    hang:reward@step=2         SIGSTOP itself (a hang: only missed heartbeats reveal it)
    stall:critic@step=2        get stuck inside process (heartbeats go on; process_timeout_s finds it)
    kill:actor@checkpoint=10   SIGKILL itself when it is about to save checkpoint step 10
    slow:reference,seconds=0.2 sleep 0.2 s before every batch
    delay:rollout,seconds=0.1  hold every outgoing message 0.1 s (outputs, and a data-parallel
                               rank's shards and answers)
    drop:rollout@step=1        silently drop its 2nd outgoing message
    corrupt:reward@step=1      send garbage frames to its consumers just before its 2nd message
    forge:reward@step=1        send a well-formed batch with the wrong tensors and the next ticket's
                               index just before its 2nd message (consumers must reject it at their
                               boundary, and still take the real one)
    fail_sync:rollout@version=2  fail the weight sync to version 2
    crash:critic               raise in setup (a node that can never start)

A fault fires in the first incarnation of the process only (a restarted node runs clean), unless
the option `every` is given. Without `@WHEN`, step=0.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field

import anyio

ACTIONS = ("kill", "hang", "stall", "slow", "delay", "drop", "corrupt", "forge", "fail_sync", "crash")
TRIGGERS = ("step", "t", "version", "checkpoint")


class FaultSpecError(ValueError):
    pass


@dataclass
class Fault:
    action: str
    node: str
    replica: int | None = None
    rank: int | None = None
    step: int | None = None
    t: float | None = None
    version: int | None = None
    checkpoint: int | None = None
    seconds: float = 0.0
    every: bool = False
    fired: bool = field(default=False, compare=False)

    @classmethod
    def parse(cls, text: str) -> "Fault":
        usage = ("write ACTION:NODE[/REPLICA[/RANK]][@step=N|@t=SECONDS|@version=V|@checkpoint=STEP][,seconds=X][,every], "
                 "e.g. kill:rollout@step=3")
        head, *opts = [p.strip() for p in text.split(",")]
        action, sep, rest = head.partition(":")
        if not sep or action not in ACTIONS:
            raise FaultSpecError(f"fault {text!r}: unknown action {action!r} (actions: {', '.join(ACTIONS)}); {usage}")
        target, _, when = rest.partition("@")
        node, _, where = target.partition("/")
        replica, _, rank = where.partition("/")
        if not node:
            raise FaultSpecError(f"fault {text!r}: no node named; {usage}")
        try:
            f = cls(action, node, int(replica) if replica else None, int(rank) if rank else None)
        except ValueError:
            raise FaultSpecError(f"fault {text!r}: replica and rank must be numbers, got {where!r}; {usage}") from None
        if when:
            key, _, value = when.partition("=")
            if key not in TRIGGERS or not value:
                raise FaultSpecError(f"fault {text!r}: bad trigger {when!r}; {usage}")
            try:
                setattr(f, key, float(value) if key == "t" else int(value))
            except ValueError:
                raise FaultSpecError(f"fault {text!r}: {key} must be a number, got {value!r}") from None
        for opt in opts:
            if opt == "every":
                f.every = True
            elif opt.startswith("seconds="):
                try:
                    f.seconds = float(opt.split("=", 1)[1])
                except ValueError:
                    raise FaultSpecError(f"fault {text!r}: seconds must be a number; {usage}") from None
            else:
                raise FaultSpecError(f"fault {text!r}: unknown option {opt!r}; {usage}")
        if f.step is None and f.t is None and f.version is None and f.checkpoint is None:
            f.step = 0
        return f

    def targets(self, node: str, replica: int, rank: int = 0) -> bool:
        return (self.node == node and (self.replica is None or self.replica == replica)
                and (self.rank is None or self.rank == rank))


def parse_faults(specs: list[str]) -> list[Fault]:
    return [Fault.parse(s) for s in specs]


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
