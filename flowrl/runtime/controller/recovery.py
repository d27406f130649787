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
"""

from __future__ import annotations

import shutil
from pathlib import Path

from flowrl.runtime.protocol.checkpoints import confine, step_dir, write_json_atomic
from flowrl.runtime.protocol.ledger import Ledger


class RecoveryBook:
    def __init__(self, run_dir: Path, members: list[str], *, keep: int, ledger: Ledger, publishers=(),
                 epoch: int = 0, committed: dict | None = None):
        self.root = Path(run_dir) / "checkpoints"
        self.root.mkdir(parents=True, exist_ok=True)
        self.members = set(members)
        self.publishers = set(publishers)
        self.keep = keep
        self.ledger = ledger
        self.epoch = epoch
        self.committed = committed
        self.reports: dict[int, dict[str, tuple[str, int]]] = {}  # step -> proc -> (file, version)

    # reports -----------------------------------------------------------------------------------
    def report(self, proc: str, *, step: int, epoch: int, file: str, version: int) -> bool:
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
        for s in [s for s in self.reports if s < step]:
            del self.reports[s]
        versions = {p: v for p, (_, v) in got.items() if p.split("/")[0] in self.publishers}
        record = {"step": step, "epoch": self.epoch, "files": {p: f for p, (f, _) in sorted(got.items())},
                  "version": max(versions.values()) if versions else step, "scheduler": scheduler_state}
        self.ledger.write("checkpoint", "-", 0, step=step, epoch=self.epoch)
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
        self.epoch += 1
        self.reports.clear()
        return self.epoch

    def file_for(self, proc: str) -> str | None:
        """Absolute path of `proc`'s state in the committed checkpoint (None: none committed)."""
        if self.committed is None:
            return None
        name = self.committed["files"].get(proc)
        return str(confine(self.root, name)) if name else None
