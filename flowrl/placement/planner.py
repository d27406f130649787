"""Plan where every node process runs, then check the plan: `make_plan(spec, inventory) -> Plan`.

    from flowrl.graph import load_graph
    from flowrl.placement import get_inventory, make_plan
    plan = make_plan(load_graph("graphs/ppo.yaml"), get_inventory())
    plan.ok, plan.entries[0], plan.findings

Order matters when devices are scarce: explicit lists are taken as written first, then counts and
`auto` by role, biggest first (actor, critic, rollout, reference, reward, then the rest; within a
role, the node asking for most devices), so the training groups get the best-connected devices.
A node that declares `colocate_with` is placed on its partners' devices when they are placed (the
relation is transitive). A weight subscriber is placed near its trainer (and a trainer near its
subscribers): same host, NVLink to their devices, so weight sync stays off the network and PCIe.
"""

from __future__ import annotations

from math import prod

from flowrl.graph.spec import GraphSpec
from flowrl.placement import extras, rules_graph, rules_hardware, rules_layout, rules_memory, rules_sharing, rules_tokens
from flowrl.placement.cpu import CpuInventory
from flowrl.placement.devices import Device, Inventory
from flowrl.placement.nvml import NvmlInventory
from flowrl.placement.findings import Finding, dedupe
from flowrl.placement.groups import Key, pick_cores, pick_gpus
from flowrl.placement.plan import Plan, PlanEntry
from flowrl.placement.requests import Request, colocation_groups, read_request
from flowrl.placement.turns import device_loads, memory_lines

ROLE_ORDER = {"actor": 0, "critic": 1, "rollout": 2, "reference": 3, "reward": 4}
CPU_WEIGHT = {"actor": 3.0, "critic": 3.0, "rollout": 1.5, "reference": 1.0, "reward": 0.25}
"""How much of a shared core a process of each role takes when CPU cores are time-shared. A trainer's
step (forward, backward, optimizer) costs about three forward passes, a rollout's generation about one
and a half, a reference's one, a reward next to nothing. Counting processes instead put the reference
on the actor's core in graphs/grpo.yaml and left the rollout's core two-thirds idle with max_staleness 1."""


def cpu_weight(cls: type | None) -> float:
    """A node class's CPU weight: its role's; without one, by its shape (a node that publishes weights
    trains, one that subscribes generates), else 1 (a user's node of unknown cost), and 0.25 for the
    built-in helpers that do next to nothing (prompts, advantages)."""
    role = getattr(cls, "role", None)
    if role in CPU_WEIGHT:
        return CPU_WEIGHT[role]
    if getattr(cls, "publishes_weights", False):
        return CPU_WEIGHT["actor"]
    if getattr(cls, "subscribes_weights", False):
        return CPU_WEIGHT["rollout"]
    return 0.25 if getattr(cls, "__module__", "").startswith("flowrl.nodes.") else 1.0


def _place(spec: GraphSpec, inv: Inventory, reqs: dict[str, Request], findings: list[Finding]) -> None:
    load: dict[Key, int] = {}
    owner: dict[Key, set[str]] = {}
    groups = colocation_groups(spec)
    sync: dict[str, set[str]] = {}
    for w in spec.weights:
        sync.setdefault(w.src, set()).add(w.dst)
        sync.setdefault(w.dst, set()).add(w.src)

    def take(req: Request, group: list[Device]) -> None:
        req.placed.append(group)
        weight = req.cpu_weight if inv.device_type == "cpu" else 1
        for d in group:
            load[d.host, d.id] = load.get((d.host, d.id), 0) + weight
            owner.setdefault((d.host, d.id), set()).add(req.name)

    for req in reqs.values():
        for group in req.explicit or []:
            take(req, group)
    order = list(spec.nodes)
    pending = sorted((r for r in reqs.values() if r.explicit is None and r.size),
                     key=lambda r: (ROLE_ORDER.get(r.role or "", 9), -r.size * r.replicas, order.index(r.name)))
    cursor: dict[str, int] = {}
    for req in pending:
        for _ in range(req.replicas):
            if inv.device_type == "cpu":
                group = pick_cores(inv, req.size, req.hosts, load, cursor)
                shared = False
            else:
                partners = {k for k, names in owner.items()
                            if any(n != req.name and groups.get(n) == groups[req.name] for n in names)}
                near = frozenset(k for k, names in owner.items() if names & sync.get(req.name, set()))
                group, shared = pick_gpus(inv, req.size, req.hosts, load, partners, near)
            assert group is not None and len(group) == req.size, "read_request checked the capacity"
            if shared and not req.short:
                req.short = True
                free = sum(1 for h in req.hosts for p in inv.host(h).visible if not load.get((h, p)))
                asked = f"{req.replicas} x {req.size}" if req.replicas > 1 else str(req.size)
                others = sorted({n for d in group for n in owner.get((d.host, d.id), ()) if n != req.name})
                findings.append(Finding(
                    "not-enough-devices", req.name,
                    f"node `{req.name}` needs {asked} GPU(s), but only {free} are free after the nodes placed "
                    f"before it, so it would share GPUs {[d.id for d in group]} with {', '.join(others) or 'itself'}. "
                    "Fix: give it explicit devices, "
                    "lower its `devices`/`replicas`, or declare `colocate_with:` for the nodes it may share with",
                    tuple(d.id for d in group), group[0].host))
            take(req, group)


def _coord(rank: int, mesh: list[int]) -> list[int]:
    out = []
    for size in reversed(mesh):
        out.append(rank % size)
        rank //= size
    return out[::-1]


def _entries(inv: Inventory, req: Request) -> list[PlanEntry]:
    out = []
    for r in range(req.replicas):
        group = req.placed[r] if req.size else []
        if not group:  # an unpinned CPU process on a GPU host
            host = inv.host(req.hosts[0])
            out.append(PlanEntry(req.name, r, 0, 0, 1, host.name, [], [], "cpu", host.address, None, [1], [0]))
            continue
        master = inv.host(group[0].host).address
        for rank, d in enumerate(group):
            same_host = [x.id for x in group if x.host == d.host]
            local_rank = sum(1 for x in group[:rank] if x.host == d.host)
            if d.type == "cuda":
                local, visible = [same_host.index(d.id)], same_host
            else:
                local, visible = [d.id], []
            out.append(PlanEntry(req.name, r, rank, local_rank, len(group), d.host, [d.id], local, d.type,
                                 master, None, list(req.mesh), _coord(rank, req.mesh) if _fits(req) else [rank],
                                 visible))
    return out


def _fits(req: Request) -> bool:
    return prod(req.mesh) == req.size


def make_plan(spec: GraphSpec, inventory: Inventory, classes: dict[str, type] | None = None) -> Plan:
    """Place every node of `spec` on `inventory` and check the result. Never raises for a bad
    placement: every problem becomes a Finding (`plan.ok` is False when any is an error)."""
    if classes is None:
        from flowrl.graph.structure import node_classes

        classes = node_classes(spec)
    findings: list[Finding] = list(inventory.notes)
    reqs: dict[str, Request] = {}
    for name, node in spec.nodes.items():
        req = read_request(name, node, getattr(classes.get(name), "role", None), inventory, findings)
        if req is not None:
            req.cpu_weight = cpu_weight(classes.get(name))
            reqs[name] = req
    findings += rules_graph.check(spec, classes)
    findings += extras.notes(spec, local=isinstance(inventory, (NvmlInventory, CpuInventory)))
    findings += rules_tokens.check(spec, classes)
    _place(spec, inventory, reqs, findings)
    needs = rules_memory.needs(spec, inventory, reqs, classes)
    loads = device_loads(spec, inventory, reqs, needs)
    findings += rules_memory.unsized(spec, inventory, reqs, classes)
    findings += rules_memory.fused(spec, inventory)
    findings += rules_sharing.check(spec, inventory, reqs, loads)
    findings += rules_hardware.check(spec, inventory, reqs)
    findings += rules_layout.check(spec, inventory, reqs)
    findings += rules_memory.check(spec, inventory, reqs, needs, loads)
    entries = [e for name in spec.nodes if name in reqs for e in _entries(inventory, reqs[name])]
    return Plan(entries, dedupe(findings), inventory.device_type, inventory.describe(), memory_lines(loads))
