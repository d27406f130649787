"""The recovery book: consistent checkpoints and recovery epochs, the one home of the rollback rule.

A consistent checkpoint at step S is every stateful node's state after exactly the tickets < S
(each saves when its in-order watermark reaches S) plus the scheduler's small state, and it
commits only when

  1. every stateful node process reported S in the current recovery epoch, and
  2. every ticket < S is consumed by every sink (so nothing before S is ever replayed).

When any stateful node restarts, `begin_recovery` opens a new epoch: reports of the old epoch no
longer count (a checkpoint half-saved when a node died is never committed), every stateful node
loads the committed checkpoint, and the tickets from its step on are issued again. `--resume` is
the same rollback after a controller death.

    book = RecoveryBook(run_dir, members=["actor/0/0", "critic/0/0"], keep=2, ledger=ledger)
    book.report("actor/0/0", step=25, epoch=0, file="step00000025/actor.0.0.e0.pt", version=25)
    book.report("critic/0/0", step=25, epoch=0, file=..., version=0)
    book.committable(complete_below=25)   # -> 25
    book.commit(25, scheduler_state)      # latest.json, ledger fsynced, old checkpoints pruned
    epoch = book.begin_recovery()         # a stateful node died: roll back to book.committed

The book holds the run's recovery epoch, the one copy of it: `begin_recovery` (and `resume`, for
`--resume`) are its only writers, and everything else that needs the epoch (the scheduler stamping
tickets, process specs, messages checked against the current epoch) asks `book.epoch`.

`Recovery` is an epoch in progress: who has yet to enter it, its deadline
(`supervision.startup_timeout_s`) and the orders sent again to whoever has not entered
(`controller.recovery.epoch_resend_s`).
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Awaitable, Callable

from flowrl.graph.spec import RecoverySpec
from flowrl.runtime.controller.procs import Proc, ProcTable
from flowrl.runtime.controller.roles import Roles
from flowrl.runtime.protocol import messages as m
from flowrl.runtime.protocol.checkpoints import confine, step_dir, write_json_atomic
from flowrl.runtime.protocol.ledger import CheckpointCommitted, Ledger, RecoveryStarted

log = logging.getLogger("flowrl.controller")


class RecoveryBook:
    def __init__(self, run_dir: Path, members: list[str], *, keep: int, ledger: Ledger, publishers=(),
                 epoch: int = 0, committed: dict | None = None):
        self.root = Path(run_dir) / "checkpoints"
        self.root.mkdir(parents=True, exist_ok=True)
        self.members = set(members)
        self.publishers = set(publishers)
        self.keep = keep
        self.ledger = ledger
        self._epoch = epoch
        self.committed = committed
        self.reports: dict[int, dict[str, tuple[str, int]]] = {}  # step -> proc -> (file, version)
        self.shards: dict[int, dict[str, dict]] = {}  # step -> proc -> {file, sha256, size, host, folder}

    @property
    def epoch(self) -> int:
        """The run's current recovery epoch (read-only: `begin_recovery` and `resume` advance it)."""
        return self._epoch

    @property
    def committed_step(self) -> int:
        """The step of the committed checkpoint (0: none yet)."""
        return self.committed["step"] if self.committed else 0

    @property
    def committed_version(self) -> int:
        return self.committed["version"] if self.committed else 0

    # reports -----------------------------------------------------------------------------------
    def report(self, proc: str, *, step: int, epoch: int, file: str, version: int, shard: dict | None = None) -> bool:
        """A stateful process saved `step`. Reports of another epoch, of a non-member, of a step
        already committed or of a file outside the checkpoint folder do not count."""
        if epoch != self.epoch or proc not in self.members:
            return False
        if self.committed is not None and step <= self.committed["step"]:
            return False
        try:
            confine(self.root, file)
        except ValueError:
            return False
        self.reports.setdefault(step, {})[proc] = (file, version)
        if shard is not None:  # where the file is and what it holds: {sha256, size, host, folder}
            self.shards.setdefault(step, {})[proc] = {"file": file, **shard}
        return True

    def committable(self, complete_below: int) -> int | None:
        """The newest step every member reported and every sink has passed, if any."""
        ready = [s for s, got in self.reports.items() if set(got) >= self.members and s <= complete_below]
        return max(ready) if ready else None

    @property
    def waiting(self) -> list[int]:
        return sorted(self.reports)

    # commit ------------------------------------------------------------------------------------
    def commit(self, step: int, scheduler_state: dict) -> dict:
        got = self.reports.pop(step)
        shards = self.shards.pop(step, {})
        for s in [s for s in self.reports if s < step]:
            del self.reports[s]
        for s in [s for s in self.shards if s < step]:
            del self.shards[s]
        versions = {p: v for p, (_, v) in got.items() if p.split("/")[0] in self.publishers}
        record = {"step": step, "epoch": self.epoch, "files": {p: f for p, (f, _) in sorted(got.items())},
                  "version": max(versions.values()) if versions else step, "scheduler": scheduler_state}
        if shards:  # each shard's file, sha256, size, host and folder there (controller/shards.py)
            record["shards"] = {p: shards[p] for p in sorted(shards) if p in got}
        self.ledger.record(CheckpointCommitted(step=step, epoch=self.epoch))
        self.ledger.sync()  # every event the checkpoint depends on is on disk before it counts
        (self.root / step_dir(step)).mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.root / step_dir(step) / "commit.json", record)
        write_json_atomic(self.root / "latest.json", record)
        self.committed = record
        self.prune()
        return record

    def prune(self) -> None:
        """Keep the newest `keep` committed checkpoints; drop older ones and stale partial saves."""
        if self.committed is None:
            return
        newest = self.committed["step"]
        committed, stale = [], []
        for d in self.root.glob("step*"):
            try:
                step = int(d.name[4:])
            except ValueError:
                continue
            if step > newest:
                continue  # being written now
            (committed if (d / "commit.json").exists() else stale).append((step, d))
        committed.sort()
        for _, d in committed[:-self.keep] + stale:
            shutil.rmtree(d, ignore_errors=True)

    # recovery ----------------------------------------------------------------------------------
    def begin_recovery(self) -> int:
        """A stateful node restarts: a new epoch; every half-collected checkpoint is abandoned."""
        self._epoch += 1
        self.reports.clear()
        self.shards.clear()
        return self._epoch

    def resume(self, record: dict) -> int:
        """Continue a run whose controller died from its committed checkpoint `record`: the epoch
        after the one it was committed in."""
        self.committed = record
        self._epoch = record.get("epoch", 0) + 1
        self.reports.clear()
        return self._epoch

    def file_for(self, proc: str, home: str | Path | None = None) -> str | None:
        """Absolute path of `proc`'s state in the committed checkpoint (None: none committed), in
        the run folder `home` of its host (`launcher.host_dirs`; default: the run directory)."""
        if self.committed is None:
            return None
        name = self.committed["files"].get(proc)
        root = self.root if home is None else Path(home) / "checkpoints"
        return str(confine(root, name)) if name else None


Send = Callable[[Proc, object], Awaitable[bool]]


class Recovery:
    """A recovery epoch in progress. The epoch itself is the book's."""

    def __init__(self, book: RecoveryBook, scheduler, procs: ProcTable, roles: Roles, *, send: Send, ledger,
                 section: RecoverySpec, startup_timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.book = book
        self.scheduler = scheduler
        self.procs = procs
        self.roles = roles
        self.send = send
        self.ledger = ledger
        self.section = section
        self.startup_timeout_s = startup_timeout_s
        self.clock = clock
        self.waiting: set[str] | None = None  # processes yet to enter the epoch; None: no recovery runs
        self.started = self.last_order = 0.0

    @property
    def active(self) -> bool:
        return self.waiting is not None

    async def begin(self, reason: str) -> int:
        """Every stateful node rolls back to the committed checkpoint; the tickets after it replay.
        Returns the new epoch."""
        epoch = self.book.begin_recovery()
        step = self.book.committed_step
        self.scheduler.rollback(step, self.book.committed_version, reason)
        self.ledger.record(RecoveryStarted(epoch=epoch, step=step, reason=reason))
        log.warning("recovery epoch %d: every stateful node back to step %d (%s)", epoch, step, reason)
        self.waiting = {p.id for p in self.procs if not p.retired}  # removed replicas never enter it
        self.started = self.last_order = self.clock()
        for proc in self.procs:
            if proc.ready and proc.down_since is None and proc.restart.at is None:
                await self.send(proc, self.order_for(proc))
        return epoch

    def order_for(self, proc: Proc) -> m.Epoch:
        """The `Epoch` order for `proc`: stateful nodes load the committed checkpoint, sinks learn
        what they consumed, everyone drops older epochs' batches."""
        epoch = self.book.epoch
        if proc.spec.node in self.roles.stateful:
            return m.Epoch(epoch=epoch, watermark=self.book.committed_step,
                           checkpoint=self.book.file_for(proc.id, proc.spec.home))
        if proc.spec.node in self.roles.sinks:
            low = self.scheduler.complete_below
            return m.Epoch(epoch=epoch, watermark=low, consumed=self.scheduler.consumed_above(proc.spec.node, low))
        return m.Epoch(epoch=epoch, watermark=0)

    def also_wait_for(self, proc_ids) -> None:
        """Processes restarting during the recovery (a stateless rank group) must enter it too."""
        if self.waiting is not None:
            self.waiting.update(proc_ids)

    def entered(self, proc: Proc, epoch: int) -> bool:
        """`proc` reports being in `epoch`. True when that ended the recovery."""
        if self.waiting is None or epoch != self.book.epoch:
            return False
        self.waiting.discard(proc.id)
        return self._over()

    def _over(self) -> bool:
        if self.waiting:
            return False
        self.waiting = None
        log.warning("recovery epoch %d complete", self.book.epoch)
        return True

    async def watch(self) -> tuple[bool, str | None]:
        """Each tick: (ended, failure). A replica `flowrl scale` removed is not waited for; orders
        go again to whoever has not entered; a recovery past `startup_timeout_s` fails naming who
        is missing."""
        if self.waiting is None:
            return False, None
        gone = self.waiting - {p.id for p in self.procs if not p.retired}
        if gone:
            self.waiting -= gone
            if self._over():
                return True, None
        now = self.clock()
        missing = [p for p in self.procs if p.id in self.waiting]
        if now - self.started > self.startup_timeout_s:
            return False, (f"recovery epoch {self.book.epoch} did not complete within {self.startup_timeout_s:.0f} s "
                           f"(supervision.startup_timeout_s); still waiting for {', '.join(p.id for p in missing)}")
        if now - self.last_order > self.section.epoch_resend_s:
            self.last_order = now
            for proc in missing:
                if proc.wired and proc.down_since is None and proc.restart.at is None:
                    await self.send(proc, self.order_for(proc))
        return False, None
