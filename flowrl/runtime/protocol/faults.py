"""Fault injection: named faults that a node process does to itself, for chaos tests.

Spec language (`flowrl run --fault SPEC`, repeatable; or `faults:` in a graph file)::

    ACTION:NODE[/REPLICA[/RANK]][@WHEN][,OPTION...]

    kill:rollout@step=3        SIGKILL itself before its 4th batch (0-based step 3)
    kill:critic@t=2.5          SIGKILL itself 2.5 s after it reported READY
    hang:reward@step=2         SIGSTOP itself (a hang: only missed heartbeats reveal it)
    stall:critic@step=2        get stuck inside process (heartbeats go on; process_timeout_s finds it)
    kill:actor@checkpoint=10   SIGKILL itself when it is about to save checkpoint step 10
    kill:rollout@request=5     SIGKILL itself on its 6th service request: a server once it took
                               the request, before it answers; a client (an agent) as it sends it
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

from dataclasses import dataclass, field

ACTIONS = ("kill", "hang", "stall", "slow", "delay", "drop", "corrupt", "forge", "fail_sync", "crash")
TRIGGERS = ("step", "t", "version", "checkpoint", "request")


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
    request: int | None = None
    seconds: float = 0.0
    every: bool = False
    fired: bool = field(default=False, compare=False)

    @classmethod
    def parse(cls, text: str) -> "Fault":
        usage = ("write ACTION:NODE[/REPLICA[/RANK]][@step=N|@t=SECONDS|@version=V|@checkpoint=STEP]|@request=N][,seconds=X][,every], "
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
        if f.step is None and f.t is None and f.version is None and f.checkpoint is None and f.request is None:
            f.step = 0
        return f

    def targets(self, node: str, replica: int, rank: int = 0) -> bool:
        return (self.node == node and (self.replica is None or self.replica == replica)
                and (self.rank is None or self.rank == rank))


def parse_faults(specs: list[str]) -> list[Fault]:
    return [Fault.parse(s) for s in specs]
