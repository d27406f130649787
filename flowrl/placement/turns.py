"""What one GPU holds when several nodes share it: the sum, or the larger turn.

    loads = device_loads(spec, inv, reqs, node_needs)        # (host, id) -> DeviceLoad
    loads["gpu-node", 0].text()   # 'max(actor 14.2 GiB, rollout 20.1 GiB) turns + reference 7.0 GiB'

Nodes on one device add up, except the members of a colocation group that takes turns
(`take_turns: true` on any member; `colocate_with` is transitive): one member works while the
others sleep, so the group needs its largest member's turn plus what each sleeping member keeps
resident. Groups that do not take turns, and nodes sharing without declaring it, add up.

What a sleeping member keeps on the card (`RESIDENT_BYTES`, an assumption): its CUDA context, since
its process stays alive. A trainer offloads weights, gradients and Adam state to host memory; a vLLM
engine at sleep level 1 moves its weights to host memory and drops its KV cache, at level 2 drops
both. Neither keeps more than the context, so a turn group needs
`max(member) + CONTEXT_BYTES x (processes of the other members there)`.

Memory that foreign processes already hold on the GPU (another job) is part of the load too:
`foreign`, counted against the card by the memory and busy-device rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flowrl.graph.spec import GraphSpec
from flowrl.placement.devices import Device, Inventory
from flowrl.placement.memory import CONTEXT_BYTES, gib
from flowrl.placement.requests import Request, colocation_groups

Key = tuple[str, int]
RESIDENT_BYTES = CONTEXT_BYTES
"""What one sleeping process of a turn group keeps on its GPU (see the module docstring)."""


@dataclass
class DeviceLoad:
    """What the plan puts on one GPU, by node, and how the nodes' needs combine there."""

    device: Device
    nodes: dict[str, int] = field(default_factory=dict)
    """Node -> bytes its processes on this GPU need while it works."""
    procs: dict[str, int] = field(default_factory=dict)
    """Node -> how many of its processes run on this GPU."""
    turns: list[list[str]] = field(default_factory=list)
    """Members present here of each colocation group that takes turns (two or more)."""

    @property
    def foreign(self) -> int:
        """Bytes other jobs' processes hold on this GPU."""
        return self.device.foreign_bytes

    def _asleep(self, group: list[str]) -> int:
        top = max(group, key=lambda n: self.nodes[n])
        return sum(min(self.nodes[n], RESIDENT_BYTES * self.procs.get(n, 1)) for n in group if n != top)

    @property
    def total(self) -> int:
        """Bytes our nodes need here at the worst moment: turn groups count their larger turn."""
        in_turns = {n for g in self.turns for n in g}
        alone = sum(b for n, b in self.nodes.items() if n not in in_turns)
        return alone + sum(max(self.nodes[n] for n in g) + self._asleep(g) for g in self.turns)

    @property
    def summed(self) -> int:
        """Bytes if every node worked at once (what the total would be without turns)."""
        return sum(self.nodes.values())

    def text(self, foreign: bool = True) -> str:
        """`max(actor 14.2 GiB, rollout 20.1 GiB) turns + 1.0 GiB asleep + reference 7.0 GiB`."""
        parts, done = [], set()
        for name in self.nodes:
            if name in done:
                continue
            group = next((g for g in self.turns if name in g), None)
            if group is None:
                parts.append(f"{name} {gib(self.nodes[name])}")
                done.add(name)
                continue
            parts.append("max(" + ", ".join(f"{n} {gib(self.nodes[n])}" for n in group) + ") turns")
            if self._asleep(group):
                parts.append(f"{gib(self._asleep(group))} asleep (CUDA context)")
            done.update(group)
        if foreign and self.foreign:
            parts.append(f"{gib(self.foreign)} of another job")
        return " + ".join(parts)


def turn_groups(spec: GraphSpec) -> dict[str, list[str]]:
    """Representative -> members, for every colocation group that takes turns."""
    groups = colocation_groups(spec)
    taking = {groups[n] for n, node in spec.nodes.items() if node.take_turns}
    out: dict[str, list[str]] = {}
    for name, rep in groups.items():
        if rep in taking:
            out.setdefault(rep, []).append(name)
    return out


def device_loads(spec: GraphSpec, inv: Inventory, reqs: dict[str, Request], node_needs: dict) -> dict[Key, DeviceLoad]:
    """(host, id) -> DeviceLoad for every GPU where a node the memory model sized is planned."""
    out: dict[Key, DeviceLoad] = {}
    for name, (need, _) in node_needs.items():
        for group in reqs[name].placed:
            for d in group:
                load = out.setdefault((d.host, d.id), DeviceLoad(d))
                load.nodes[name] = load.nodes.get(name, 0) + need.total
                load.procs[name] = load.procs.get(name, 0) + 1
    turning = turn_groups(spec)
    for load in out.values():
        for members in turning.values():
            here = [n for n in load.nodes if n in members]
            if len(here) > 1:
                load.turns.append(here)
    return out


def memory_lines(loads: dict[Key, DeviceLoad]) -> list[dict]:
    """One line per set of GPUs holding the same load (for `flowrl check` and its JSON)."""
    rows: dict[tuple, dict] = {}
    for (host, dev), load in sorted(loads.items()):
        if not load.device.memory_bytes:
            continue
        text = load.text()
        row = rows.setdefault((host, text, load.device.memory_bytes), {
            "host": host, "devices": [], "text": text, "bytes": load.total + load.foreign,
            "summed_bytes": load.summed + load.foreign, "capacity_bytes": load.device.memory_bytes,
            "turns": bool(load.turns), "shared": len(load.nodes) > 1 or bool(load.foreign)})
        row["devices"].append(dev)
    return list(rows.values())
