"""Random fault schedules for a shape, seeded: 1-3 faults drawn from

    kill          SIGKILL any node (or one replica) before its N-th batch
    double_kill   two crashes (two nodes, stateful ones preferred) inside one checkpoint interval
    kill_commit   SIGKILL a stateful node when ordered to save checkpoint N (a kill during a commit)
    sigstop       SIGSTOP (only missed heartbeats reveal it)
    stall         stuck inside `process` while its heartbeat thread keeps beating
    drop_message  an outgoing message silently lost (the ticket must be re-issued)
    corrupt       garbage frames sent to a node's consumers (they must reject them)
    poison        every incarnation of a node hangs at its first batch: the run cannot finish and
                  must fail with an error naming the node (or finish, if replicas do the work)
    kill_rank     SIGKILL one rank of a data-parallel node (only in shapes that have one)

and, with `scale=True`, a scale event pair first (`Schedule.scales`, carried out by the trial
through `flowrl scale` at observed progress: tickets completed in the ledger):

    scale         `flowrl scale` a stateless node up (+1 or +2 replicas) after a tickets
                  completed, then down (to fewer than that) after b > a
    scale_kill    the same, and SIGKILL one of the added replicas 0.5-2 s after its READY; the
                  scale-down waits until that replica went down and came back, and removes it

A fault on a data-parallel node names a rank (`kill:NODE/0/RANK`) where it acts in that rank
alone (kill, SIGSTOP, stall, kill at a checkpoint); a dropped or corrupt message names rank 0, the
one that sends.

Steps are aimed with the shape's model (`expected.reached`): a fault at step N of a node fires
before the N-th batch that node processes, and N is drawn among the batches that reach it.
When the runtime lacks an action (`Features`), the same draw maps to the nearest action it has
(stall -> hang, kill at checkpoint -> kill at that ticket) and `Schedule.substituted` says so.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from flowrl.testing.chaos.features import Features
from flowrl.testing.chaos.model import Expected
from flowrl.testing.chaos.shapes import Shape

KINDS = ("kill", "double_kill", "kill_commit", "sigstop", "stall", "drop_message", "corrupt", "poison")
WEIGHTS = (5, 2, 2, 2, 2, 2, 2, 1)
RANK_KINDS, RANK_WEIGHTS = ("kill_rank",), (3,)
"""Drawn too in shapes with data-parallel nodes (shapes without keep the draws they always had)."""
SCALE_KINDS = ("scale", "scale_kill")


@dataclass
class Schedule:
    shape_seed: int
    seed: int
    faults: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    substituted: list[str] = field(default_factory=list)
    scales: list[str] = field(default_factory=list)
    """`scale:NODE=R@completed=N[,after=NODE/REPLICA]`, in order: the trial asks the run's controller
    for R replicas of NODE (`flowrl scale`) once N tickets completed (and, with `after`, once that
    replica went down and came back)."""

    @property
    def id(self) -> str:
        return f"s{self.shape_seed}.{self.seed}"

    @property
    def recoverable(self) -> bool:
        """Every fault here is one the runtime must recover from (the run must complete)."""
        return "poison" not in self.kinds

    def describe(self) -> str:
        sub = f"  (substituted: {'; '.join(self.substituted)})" if self.substituted else ""
        return f"{self.id} [{', '.join(self.kinds)}] " + " ".join(self.scales + self.faults) + sub


def random_schedule(shape: Shape, expected: Expected, seed: int, features: Features | None = None,
                    scale: bool = False) -> Schedule:
    """1-3 faults for `shape` (the same for the same shape, seed and features). `scale=True`: a
    scale event pair (`scale` or `scale_kill`) and 0-2 faults more, when the shape has a node to
    scale."""
    features = features or Features.detect()
    rng = random.Random(f"schedule:{shape.seed}:{seed}")
    sched = Schedule(shape.seed, seed)
    budget = rng.randint(1, 3)
    if scale and shape.scalable:
        kind = rng.choice(SCALE_KINDS)
        sched.kinds.append(kind)
        sched.faults += _scale_events(kind, shape, expected, rng, sched)
        budget = rng.randint(0, 2)
    kinds, weights = KINDS, WEIGHTS
    if any(d.ranks > 1 for d in shape.nodes.values()):
        kinds, weights = KINDS + RANK_KINDS, WEIGHTS + RANK_WEIGHTS
    while budget > 0:
        kind = rng.choices(kinds, weights)[0]
        if kind == "double_kill" and budget < 2:
            kind = "kill"
        budget -= 2 if kind == "double_kill" else 1
        sched.kinds.append(kind)
        sched.faults += _faults(kind, shape, expected, rng, features, sched)
    return sched


def _target(shape: Shape, expected: Expected, rng: random.Random, names: list[str],
            used: set[str] = frozenset(), rank: bool = True) -> tuple[str, int]:
    """A node (or one replica of it) among `names`, not in `used` if it can be helped, and a step
    that its batches reach. On a data-parallel node: one of its ranks (`rank=False`: rank 0)."""
    names = [n for n in names if expected.calls[n] and shape.nodes[n].fuse_into is None] or shape.running[:1]
    names = [n for n in names if n not in used] or names
    name = rng.choice(names)
    d = shape.nodes[name]
    per_replica = max(1, len(expected.calls[name]) // d.replicas)
    return _who(d, rng, rank), rng.randrange(per_replica)


def _who(d, rng: random.Random, rank: bool = True) -> str:
    """A fault's target: the node, one replica of it, or one rank of a data-parallel node."""
    who = f"{d.name}/{rng.randrange(d.replicas)}" if d.replicas > 1 else d.name
    if d.ranks > 1:
        who = f"{d.name}/0/{rng.randrange(d.ranks) if rank else 0}"
    return who


def _step_at(shape: Shape, expected: Expected, name: str, index: int) -> int:
    """The step of node `name` at which ticket `index` (or the next one reaching it) arrives (in a
    `ticket: group` shape, a stateful sink's call of the update that holds it, or the next one)."""
    d = shape.nodes[name]
    return sum(1 for i in expected.calls[name] if i < index) // d.replicas


def _faults(kind: str, shape: Shape, expected: Expected, rng: random.Random, features: Features,
            sched: Schedule) -> list[str]:
    everyone = shape.running  # a fused node's faults are its host's: the host is in here
    used = {f.split(":", 1)[1].split("@")[0].split("/")[0].split(",")[0] for f in sched.faults}
    producers = [n for n in everyone if not shape.nodes[n].sink]
    stateful = shape.stateful
    if kind == "kill":
        who, step = _target(shape, expected, rng, everyone, used)
        return [f"kill:{who}@step={step}"]
    if kind == "sigstop":
        who, step = _target(shape, expected, rng, everyone, used)
        return [f"hang:{who}@step={step}"]
    if kind == "stall":
        who, step = _target(shape, expected, rng, everyone, used)
        seconds = rng.choice((0.5, 2 * shape.timing.process_timeout_s))
        if not features.stall:
            sched.substituted.append(f"stall:{who}@step={step} -> hang (no `stall` action)")
            return [f"hang:{who}@step={step}"]
        return [f"stall:{who}@step={step},seconds={seconds:g}"]
    if kind == "drop_message":
        who, step = _target(shape, expected, rng, producers, used, rank=False)
        return [f"drop:{who}@step={step}"]
    if kind == "corrupt":
        who, step = _target(shape, expected, rng, producers, used, rank=False)
        return [f"corrupt:{who}@step={step}"]
    if kind == "kill_rank":
        who, step = _target(shape, expected, rng, [n for n, d in shape.nodes.items() if d.ranks > 1], used)
        return [f"kill:{who}@step={step}"]
    if kind == "double_kill":
        k = shape.checkpoint_tickets
        interval = rng.randrange(max(1, shape.tickets // k))
        lo, hi = interval * k, min(shape.tickets, (interval + 1) * k)
        pool = [n for n in (stateful if len(stateful) >= 2 else everyone) if n not in used]  # stateful: never fused
        a, b = rng.sample(pool if len(pool) >= 2 else everyone, 2)
        out = []
        for name in (a, b):
            index = rng.randrange(lo, hi)
            who = _who(shape.nodes[name], rng)
            out.append(f"kill:{who}@step={_step_at(shape, expected, name, index)}")
        return out
    if kind == "kill_commit":
        if not stateful:
            who, step = _target(shape, expected, rng, everyone, used)
            sched.substituted.append("kill during a commit -> kill (no stateful node)")
            return [f"kill:{who}@step={step}"]
        name = rng.choice([n for n in stateful if n not in used] or stateful)
        k = shape.checkpoint_tickets  # a checkpoint's step counts tickets
        points = [c for c in range(k, shape.tickets, k)] + [shape.tickets]
        at = rng.choice(points)
        who = _who(shape.nodes[name], rng) if shape.nodes[name].ranks > 1 else name
        if not features.kill_at_checkpoint:
            step = _step_at(shape, expected, name, at)
            sched.substituted.append(f"kill:{who}@checkpoint={at} -> kill:{who}@step={step} (no `@checkpoint`)")
            return [f"kill:{who}@step={step}"]
        return [f"kill:{who}@checkpoint={at}"]
    if kind == "poison":
        who, _ = _target(shape, expected, rng, everyone, used)
        action = "stall" if features.stall else "hang"
        opts = ",seconds=600" if action == "stall" else ""
        return [f"{action}:{who}@step=0{opts},every"]
    raise ValueError(f"unknown fault kind {kind!r}; kinds: {', '.join(KINDS)}")


def _scale_events(kind: str, shape: Shape, expected: Expected, rng: random.Random, sched: Schedule) -> list[str]:
    """A scale-up and a later scale-down of one stateless node (into `sched.scales`); for
    `scale_kill`, the kill of an added replica (returned, a fault like the others)."""
    names = shape.scalable
    subs = [n for n in names if shape.nodes[n].cls == "Sub"]
    name = rng.choice(subs) if subs and rng.random() < 0.6 else rng.choice(names)  # weight sync membership
    old = shape.nodes[name].replicas
    up = old + rng.choice((1, 2)) if old < 2 else old + 1
    total = expected.total
    a = rng.randint(1, max(1, total // 4))
    b = rng.randint(a + 1, max(a + 1, total // 2))
    down = rng.randint(1, up - 1)
    sched.scales.append(f"scale:{name}={up}@completed={a}")
    if kind == "scale":
        sched.scales.append(f"scale:{name}={down}@completed={b}")
        return []
    added = rng.randrange(old, up)
    down = min(down, added)  # the scale-down removes the replica that was killed (and restarted)
    sched.scales.append(f"scale:{name}={down}@completed={b},after={name}/{added}")
    # by time after its READY, not by step: a replica that just joined may get no batch at all (few
    # tickets in flight go to the replicas that had credit first)
    return [f"kill:{name}/{added}@t={rng.choice((0.5, 1, 2))}"]
