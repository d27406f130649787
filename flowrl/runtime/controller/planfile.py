"""RUN_DIR/plan.json kept current: rewritten whenever the processes of the run change.

    planfile = PlanFile(run_dir, plan, ledger)
    planfile.changed("scale rollout 1 -> 2", added={"rollout/1/0": "host-b"})

The run starts with the plan `flowrl run` wrote (revision 0). `flowrl scale` (replicas added or
removed) and a re-plan after a lost host (processes moved) change it: the file is written again,
atomically (a temporary file, then a rename), with the entries as they are now and a `revision`
number, and a `plan` event in the ledger says what changed, so the history is in the ledger and
the file is the present. The Ray launcher reads the file for a process it does not know yet.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from flowrl.runtime.protocol.ledger import PlanChanged


class PlanFile:
    """The one writer of RUN_DIR/plan.json after the start (the plan's entries are Wiring's)."""

    def __init__(self, run_dir: Path, plan, ledger):
        self.path = Path(run_dir) / "plan.json"
        self.plan = plan
        self.ledger = ledger
        self.revision = 0

    def changed(self, why: str, *, added: dict | None = None, removed: list | None = None,
                moved: dict | None = None) -> None:
        self.revision += 1
        write_plan(self.path, {**self.plan.to_json(), "revision": self.revision})
        if self.ledger is not None:
            self.ledger.record(PlanChanged(revision=self.revision, why=why, added=dict(added or {}),
                                           removed=list(removed or []), moved=dict(moved or {})))


def write_plan(path: Path, data: dict) -> None:
    """Write plan.json so that a reader sees the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
