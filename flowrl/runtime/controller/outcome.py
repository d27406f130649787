"""How the run ends: the one writer of its failure (the first one counts) and of the signal that
interrupted it. Components that can fail the run are handed `Outcome.fail`."""

from __future__ import annotations

import logging
import signal

from flowrl.runtime.controller.procs import Proc
from flowrl.runtime.controller.supervisor import Supervisor
from flowrl.runtime.protocol.ledger import RunFailure

log = logging.getLogger("flowrl.controller")


class Outcome:
    """How the run ends: the one writer of its failure (the first one counts) and of the signal
    that interrupted it."""

    def __init__(self, supervisor: Supervisor, ledger):
        self.supervisor = supervisor
        self.ledger = ledger
        self.failure: str | None = None
        self.interrupted: int | None = None

    def fail(self, proc: Proc | None, why: str) -> None:
        if self.failure:
            return
        self.failure = self.supervisor.describe(proc, why) if proc is not None else why
        self.ledger.record(RunFailure(why=self.failure.splitlines()[0][:500]))
        log.error("run failed: %s", self.failure)

    def interrupt(self, signum: int) -> None:
        self.failure = f"interrupted by {signal.Signals(signum).name}; every node process was stopped"
        self.interrupted = signum
