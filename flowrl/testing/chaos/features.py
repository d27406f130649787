"""Which of the runtime's newer knobs and fault actions this checkout has, so that generated graphs
and fault schedules leave out what it cannot load (and say what they replaced)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Features:
    process_timeout: bool = False
    """`supervision.process_timeout_s`: one call to `process` running longer = hung."""
    max_attempts: bool = False
    """`schedule.max_attempts`: a ticket re-issued more often fails the run, naming it."""
    keep_checkpoints: bool = False
    """`schedule.keep_checkpoints`: old checkpoints are pruned."""
    stall: bool = False
    """Fault `stall:NODE@step=N[,seconds=S]`: stuck inside `process` while heartbeats go on."""
    kill_at_checkpoint: bool = False
    """Fault `kill:NODE@checkpoint=N`: SIGKILL when ordered to save checkpoint N."""

    @classmethod
    def detect(cls) -> Features:
        from flowrl.graph.spec import ScheduleSpec, SupervisionSpec
        from flowrl.runtime.protocol.faults import ACTIONS, Fault

        try:
            Fault.parse("kill:x@checkpoint=1")
            at_checkpoint = True
        except ValueError:
            at_checkpoint = False
        return cls(process_timeout="process_timeout_s" in SupervisionSpec.model_fields,
                   max_attempts="max_attempts" in ScheduleSpec.model_fields,
                   keep_checkpoints="keep_checkpoints" in ScheduleSpec.model_fields,
                   stall="stall" in ACTIONS, kill_at_checkpoint=at_checkpoint)

    @classmethod
    def all(cls) -> Features:
        return cls(True, True, True, True, True)

    def missing(self) -> list[str]:
        return [k for k, v in self.__dict__.items() if not v]
