"""Colocated nodes that take turns on their devices (`take_turns`): who holds a group's turn.

    book = TurnBook({"actor": "actor", "rollout": "actor"})   # node -> its group (turn_groups)
    book.ready("rollout/0/0")                 # set up: awake (its memory in use) at turn 0
    book.ask("actor/0/0", index=3)            # -> [("yield", "rollout/0/0", 0)]
    book.released("rollout/0/0", turn=0)      # -> [("grant", "actor/0/0", 1)]
    book.down("actor/0/0")                    # a dead holder holds nothing: the next one is granted

The rule this owns: in a group at most one member is awake once turns began, and a member is
granted only when every other member has released (slept). A member asks only when it needs its
devices (a call into its node, a state load or save) and keeps the turn until another member asks
(`yield`): a rollout that generates several tickets ahead under `max_staleness` sleeps once, not
after each. Requests are granted in the scheduler's order: the lowest ticket index first, then the
order they came in, so the rollout's ticket n goes before the actor's update on ticket n when both
wait. A member that dies or is removed holds nothing; its restart is awake from READY (its setup
used the memory) until it releases. Nothing here waits: the worker's wait for a grant has its
deadline (`turn_timeout_s` of its process spec, worker/turns.py).
"""

from __future__ import annotations

import itertools
import logging

from flowrl.runtime.protocol import messages as m
from flowrl.runtime.protocol.errors import RunFailed

log = logging.getLogger("flowrl.controller")


def colocation_groups(spec) -> dict[str, str]:
    """Node -> the name of its colocation group (`colocate_with`, transitive), for groups of two or more."""
    from flowrl.placement.requests import colocation_groups as representatives

    groups: dict[str, list[str]] = {}
    for n, rep in representatives(spec).items():
        groups.setdefault(rep, []).append(n)
    return {n: "+".join(sorted(members)) for members in groups.values() if len(members) > 1 for n in members}


def turn_groups(spec) -> dict[str, str]:
    """Node -> the name of its take-turns group: the colocation groups in which some member says
    `take_turns: true`. Nodes of other groups are not in it."""
    groups = colocation_groups(spec)
    turning = {g for n, g in groups.items() if getattr(spec.nodes[n], "take_turns", False)}
    return {n: g for n, g in groups.items() if g in turning}


def refuse_multi_rank(spec, groups: dict[str, str]) -> None:
    """A data-parallel node's ranks meet in collectives inside one call: a turn per process would
    hold one rank while the others wait for it. Refused, naming the node and the fix."""
    for n in groups:
        devices = spec.nodes[n].devices
        count = devices if isinstance(devices, int) else len(devices) if isinstance(devices, list) else 1
        if count > 1:
            raise RunFailed(f"node {n!r} takes turns (take_turns in its colocation group {groups[n]!r}) but runs "
                             f"{count} ranks (devices: {devices}); turns are per process: give it one device, or "
                             "drop take_turns from the group")


class TurnBook:
    """Who is awake, who holds and who waits, per take-turns group (pure state, no sockets)."""

    def __init__(self, groups: dict[str, str]):
        self.groups = groups  # node -> group
        self.awake: dict[str, dict[str, int]] = {}  # group -> {member: its turn number}
        self.waiting: dict[str, dict[str, tuple[int, int]]] = {}  # group -> {member: (index, arrival)}
        self.yielding: dict[str, set[str]] = {}  # group -> members told to yield, not yet released
        self.turns = itertools.count(1)
        self.arrivals = itertools.count()
        self.grants = 0  # turns granted so far (a run's metric)

    def group_of(self, proc_id: str) -> str | None:
        return self.groups.get(proc_id.split("/", 1)[0])

    def ready(self, proc_id: str) -> list[tuple]:
        """A member (re)started and set up: awake at turn 0 until it releases."""
        g = self.group_of(proc_id)
        if g is None:
            return []
        self.waiting.get(g, {}).pop(proc_id, None)
        self.yielding.get(g, set()).discard(proc_id)
        self.awake.setdefault(g, {})[proc_id] = 0
        return self._next(g)

    def ask(self, proc_id: str, index: int) -> list[tuple]:
        g = self.group_of(proc_id)
        if g is None:
            return []
        if proc_id in self.awake.get(g, {}) and proc_id not in self.yielding.get(g, set()):
            # it asks while we think it awake: its release crossed our books (it slept); it is not
            self.awake[g].pop(proc_id)
        self.waiting.setdefault(g, {}).setdefault(proc_id, (index, next(self.arrivals)))
        return self._next(g)

    def released(self, proc_id: str, turn: int) -> list[tuple]:
        g = self.group_of(proc_id)
        if g is None:
            return []
        awake = self.awake.get(g, {})
        if proc_id in awake and awake[proc_id] <= turn:  # an older turn's release changes nothing
            awake.pop(proc_id)
            self.yielding.get(g, set()).discard(proc_id)
        return self._next(g)

    def down(self, proc_id: str) -> list[tuple]:
        """A member died or was removed: it holds nothing, waits for nothing."""
        g = self.group_of(proc_id)
        if g is None:
            return []
        self.awake.get(g, {}).pop(proc_id, None)
        self.waiting.get(g, {}).pop(proc_id, None)
        self.yielding.get(g, set()).discard(proc_id)
        return self._next(g)

    def holder(self, group: str) -> list[str]:
        return sorted(self.awake.get(group, {}))

    def _next(self, g: str) -> list[tuple]:
        """The first waiter in the scheduler's order gets the turn once nobody else is awake; until
        then every other awake member is told (once) to yield. A holder granted while others still
        wait is told to yield at once (it keeps the turn for the call it asked for): nobody waits
        on a holder that was never asked to yield."""
        waiting = self.waiting.get(g, {})
        if not waiting:
            return []
        first = min(waiting, key=lambda p: waiting[p])
        awake, yielding = self.awake.setdefault(g, {}), self.yielding.setdefault(g, set())
        others = [p for p in awake if p != first]
        if others:
            actions = [("yield", p, awake[p]) for p in others if p not in yielding]
            yielding.update(p for p, _ in ((a[1], a[2]) for a in actions))
            return actions
        waiting.pop(first)
        turn = next(self.turns)
        awake[first] = turn
        self.grants += 1
        if not waiting:
            return [("grant", first, turn)]
        yielding.add(first)  # others wait still: the new holder releases after the calls it was granted for
        return [("grant", first, turn), ("yield", first, turn)]


class Turns:
    """The controller's side: messages in, orders out, a dead member's turn given back."""

    def __init__(self, book: TurnBook, procs, send):
        self.book = book
        self._procs = procs
        self._send = send

    @property
    def active(self) -> bool:
        return bool(self.book.groups)

    async def act(self, actions: list[tuple]) -> None:
        for what, proc_id, turn in actions:
            proc = self._procs.get(proc_id)
            if proc is None or not proc.alive:
                continue
            msg = m.TurnGrant(turn=turn) if what == "grant" else m.TurnYield(turn=turn)
            log.debug("turn %s: %s %s", turn, what, proc_id)
            await self._send(proc, msg)

    async def on_ask(self, proc, msg: m.TurnAsk) -> None:
        await self.act(self.book.ask(proc.id, msg.index))

    async def on_released(self, proc, msg: m.TurnReleased) -> None:
        await self.act(self.book.released(proc.id, msg.turn))

    async def ready(self, proc) -> None:
        if self.active:
            await self.act(self.book.ready(proc.id))

    async def down(self, proc) -> None:
        if self.active:
            await self.act(self.book.down(proc.id))
