"""The controller's table of node processes: specs, handles, liveness, restart budgets.

One `Proc` per (node, replica, rank) of the plan. It survives restarts of the process it stands
for: the incarnation counts them, and the control-plane identity includes it, so a message from a
dead incarnation can never be mistaken for the new one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from flowrl.runtime.launch.launcher import ProcessHandle, describe_exit
from flowrl.runtime.protocol.procspec import ProcSpec


@dataclass
class Restart:
    """Its restart budget (supervisor.py): restarts so far, when the next one is due (backoff),
    and the previous incarnation's error (type, message, file, line, ticket)."""

    count: int = 0
    at: float | None = None
    signature: tuple | None = None


@dataclass
class Removal:
    """Removed by `flowrl scale`: stopping, not a failure."""

    at: float | None = None  # when (it is stopped by PID if it outstays its grace)
    terminated: bool = False  # it outstayed its grace and got SIGTERM


@dataclass
class Proc:
    spec: ProcSpec
    handle: ProcessHandle | None = None
    pid: int | None = None
    store_port: int | None = None  # publishers: their TCPStore
    first_incarnation: int = 0  # a replica added again while its removed predecessor still ran starts above it
    # seen from its messages
    ready: bool = False
    wired: bool = False
    started_at: float = 0.0
    last_seen: float = 0.0
    busy: tuple | None = None  # (batch_id, seconds) inside one node call, from the heartbeat thread
    error: "NodeFailure | None" = None  # last error the process reported
    version: int = -1  # weights version it holds (subscribers)
    down_since: float | None = None
    restart: Restart = field(default_factory=Restart)
    removed: Removal | None = None

    @property
    def retired(self) -> bool:
        return self.removed is not None

    @property
    def id(self) -> str:
        return self.spec.proc_id

    @property
    def identity(self) -> bytes:
        return f"{self.id}#{self.spec.incarnation}".encode()

    @property
    def alive(self) -> bool:
        return self.handle is not None and self.handle.poll() is None

    def log_tail(self, run_dir: Path, lines: int = 15) -> str:
        """The last lines of its log (in its host's folder when `launcher.host_dirs` lists the host)."""
        path = Path(self.spec.home) / "logs" / f"{self.spec.log_name}.log"
        try:
            text = path.read_text(errors="replace").splitlines()
        except OSError:
            if self.spec.own_dir:  # another host's folder: not readable from the controller's host
                return f"(the log is on host {self.spec.host!r} at {path}; read it there)"
            return "(no log)"
        return "\n".join(text[-lines:])

    def describe(self) -> str:
        code = self.handle.poll() if self.handle else None
        return f"{self.id} (pid {self.pid}, {describe_exit(code)})"


@dataclass
class NodeFailure:
    """What a node process reported before it failed (the `error` control message)."""

    where: str
    type: str
    message: str
    file: str | None = None
    line_no: int | None = None
    batch_id: str | None = None
    traceback: str = ""

    def line(self) -> str:
        at = f" at {self.file}:{self.line_no}" if self.file else ""
        ticket = f" (ticket {self.batch_id})" if self.batch_id else ""
        text = f"{self.where}: {self.type}: {self.message}{at}{ticket}"
        if self.where == "setup" and self.traceback:
            text += "\n" + self.traceback[-2000:]
        return text

    def signature(self) -> tuple | None:
        if self.where == "setup":
            return None  # setup failures are budgeted as before (a missing file may appear)
        return (self.type, self.message, self.file, self.line_no, self.batch_id)


@dataclass
class ProcTable:
    procs: dict[str, Proc] = field(default_factory=dict)

    def add(self, proc: Proc) -> None:
        self.procs[proc.id] = proc

    def get(self, proc_id: str) -> Proc | None:
        return self.procs.get(proc_id)

    def remove(self, proc: Proc) -> None:
        """Forget `proc` (a removed replica that is gone, or one a new replica displaces)."""
        del self.procs[proc.id]

    def by_identity(self, identity: bytes) -> tuple[Proc | None, bool]:
        """(proc, current) for `node/replica/rank#incarnation` or the same + `#hb`, matched
        exactly; `current` is False for messages from an old incarnation."""
        text = identity.decode(errors="replace")
        parts = text.split("#")
        proc = self.procs.get(parts[0])
        if proc is None or len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "hb"):
            return None, False
        return proc, parts[1] == str(proc.spec.incarnation)

    def of_node(self, node: str) -> list[Proc]:
        return [p for p in self.procs.values() if p.spec.node == node]

    def __iter__(self):
        return iter(self.procs.values())

    def seen(self, proc: Proc) -> None:
        proc.last_seen = time.monotonic()
