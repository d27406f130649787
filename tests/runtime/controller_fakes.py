"""Fakes for unit tests of the controller's components (flowrl/runtime/controller/): real `Proc`
records in a real `ProcTable`, a `send` that records what each process was told, a `fail` that
records why the run failed. No processes, no sockets."""

from __future__ import annotations

from flowrl.runtime.controller.procs import Proc, ProcTable
from flowrl.runtime.protocol.ledger import Ledger
from flowrl.runtime.protocol.procspec import ProcSpec


def proc(pid: str, *, ready=True, wired=True, incarnation=0, host="local", **state) -> Proc:
    node, replica, rank = pid.split("/")
    spec = ProcSpec(node=node, kind="x", replica=int(replica), replicas=1, rank=int(rank), world_size=1,
                    incarnation=incarnation, run_dir="r", graph_file="g", control="ipc://c", host=host)
    return Proc(spec=spec, ready=ready, wired=wired, **state)


def table(*pids: str, **state) -> ProcTable:
    procs = ProcTable()
    for pid in pids:
        procs.add(proc(pid, **state))
    return procs


class Outbox:
    """`send` for components: records (proc id, message) and answers True (delivered)."""

    def __init__(self):
        self.sent: list[tuple[str, object]] = []

    async def __call__(self, proc: Proc, msg) -> bool:
        self.sent.append((proc.id, msg))
        return True

    def of(self, kind: type) -> list[tuple[str, object]]:
        return [(who, msg) for who, msg in self.sent if isinstance(msg, kind)]

    def clear(self) -> None:
        self.sent.clear()


class Failures:
    """`fail` for components: the first failure counts, as in `Outcome.fail`."""

    def __init__(self):
        self.why: list[str] = []

    def __call__(self, proc, why: str) -> None:
        self.why.append(why)


def ledger(tmp_path) -> Ledger:
    return Ledger(tmp_path / "ledger.jsonl")


class Clock:
    """A clock the test sets: `clock.now = ...`; components call `clock()`."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now
