"""What each node asks for, read against the inventory: explicit ids resolved, sizes and meshes checked.

    devices: [0, 1, 2, 3]   explicit logical ids (or "host:id"), split evenly over `replicas`
    devices: 2              a count per replica, the planner picks which
    devices: auto           the planner picks; prod(mesh) devices per replica, else one

Explicit ids are *logical*: what the controller sees under its CUDA_VISIBLE_DEVICES (on CPU, core
numbers). A node that cannot be placed as written gets a finding here and no plan entries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

from flowrl.graph.spec import GraphSpec, NodeSpec
from flowrl.placement.devices import Device, Inventory
from flowrl.placement.findings import Finding, ids_text


PROCESSES_PER_CORE = 16
"""On CPU, processes time-share cores; more than this many per core is a mistake, not a plan."""
MAX_UNPINNED = 1024
"""Most replicas of a role-less CPU helper on a GPU host."""


@dataclass
class Request:
    """A node's placement request, checked. `explicit` holds resolved devices per replica."""

    name: str
    role: str | None
    replicas: int
    size: int
    """Devices per replica (0: a CPU process left unpinned, for role-less `auto` nodes on GPU hosts)."""
    mesh: list[int]
    hosts: list[str]
    """Hosts it may go on, in preference order."""
    explicit: list[list[Device]] | None = None
    placed: list[list[Device]] = field(default_factory=list)
    short: bool = False
    """It had to share devices because too few were free (already reported)."""
    cpu_weight: float = 1.0
    """How much of a time-shared CPU core one of its processes takes (planner.py, `cpu_weight`)."""


def colocation_groups(spec: GraphSpec) -> dict[str, str]:
    """Node -> a representative of its colocation group. `colocate_with` is transitive: a hybrid
    engine declared as A~B and B~C puts A, B and C in one group."""
    parent = {n: n for n in spec.nodes}

    def find(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for name, node in spec.nodes.items():
        for other in node.colocate_with:
            if other in parent:
                parent[find(name)] = find(other)
    return {n: find(n) for n in spec.nodes}


def colocated(spec: GraphSpec, a: str, b: str) -> bool:
    """Sharing devices was declared, directly or through other nodes (`colocate_with` is transitive)."""
    groups = colocation_groups(spec)
    return a in groups and b in groups and groups[a] == groups[b]


def _resolve(name: str, node: NodeSpec, inv: Inventory, findings: list[Finding]) -> list[Device] | None:
    default = node.host or inv.hosts[0].name
    out: list[Device] = []
    for entry in node.devices:  # type: ignore[union-attr]
        h, i = (entry.rsplit(":", 1)[0], int(entry.rsplit(":", 1)[1])) if isinstance(entry, str) else (default, entry)
        host = inv.host(h)
        if host is None:
            findings.append(Finding("unknown-host", name, f"node `{name}` names device {entry!r} on host {h!r}, but the "
                                    f"inventory has hosts {[x.name for x in inv.hosts]}. Fix: use one of those host names"))
            continue
        if node.host and h != node.host:
            findings.append(Finding("device-not-visible", name, f"node `{name}` is pinned to host {node.host!r} but lists "
                                    f"device {entry!r} on host {h!r}. Fix: drop `host:` or list devices of {node.host!r}",
                                    (i,), h))
            continue
        where = f" on host {h}" if inv.multi_host else ""
        if inv.device_type == "cpu":
            if i not in host.visible:
                findings.append(Finding("device-not-visible", name, f"node `{name}` uses core {i}{where}, but this process may "
                                        f"only run on cores {ids_text(host.visible)} (os.sched_getaffinity). Fix: pick cores "
                                        "from those, or use `devices: auto`", (i,), h))
                continue
            out.append(host.devices[i])
            continue
        phys = host.physical(i)
        if phys is None:
            n = len(host.visible)
            rng = f"0-{n - 1}" if n > 1 else ("0" if n else "none")
            findings.append(Finding("device-not-visible", name, f"node `{name}` uses device {i}{where}, but only devices {rng} "
                                    f"are visible ({host.mapping_text()}); CUDA would fail with `invalid device ordinal`. "
                                    f"Fix: pick devices from {rng}, or widen CUDA_VISIBLE_DEVICES", (i,), h))
            continue
        out.append(host.devices[phys])
    return out if len(out) == len(node.devices) else None  # type: ignore[arg-type]


def _mesh_fix(mesh: list[int], size: int) -> str:
    """A mesh of the right size that keeps as much of the written one as possible."""
    if len(mesh) == 2 and 1 < mesh[0] < size and size % mesh[0] == 0:
        return f"use mesh {[mesh[0], size // mesh[0]]} or {[size]}"
    if len(mesh) == 2 and 1 < mesh[1] < size and size % mesh[1] == 0:
        return f"use mesh {[size // mesh[1], mesh[1]]} or {[size]}"
    return f"use mesh {[size]}"


def read_request(name: str, node: NodeSpec, role: str | None, inv: Inventory, findings: list[Finding]) -> Request | None:
    """The node's request, or None when it cannot be placed (findings say why)."""
    if node.host and inv.host(node.host) is None:
        findings.append(Finding("unknown-host", name, f"node `{name}` asks for host {node.host!r}, but the inventory has "
                                f"hosts {[h.name for h in inv.hosts]}. Fix: use one of those, or drop `host:`"))
        return None
    hosts = [node.host] if node.host else [h.name for h in inv.hosts]
    unit = "GPU" if inv.device_type == "cuda" else "core"
    req = Request(name, role, node.replicas, 0, list(node.mesh or []), hosts)
    if isinstance(node.devices, list):
        devs = _resolve(name, node, inv, findings)
        if devs is None:
            return None
        if len(devs) % node.replicas:
            findings.append(Finding("replica-split", name, f"node `{name}` lists {len(devs)} devices for {node.replicas} "
                                    f"replicas, which does not split evenly. Fix: list a multiple of {node.replicas} "
                                    "devices, or change `replicas`", tuple(d.id for d in devs)))
            return None
        req.size = len(devs) // node.replicas
        req.explicit = [devs[r * req.size:(r + 1) * req.size] for r in range(node.replicas)]
    elif isinstance(node.devices, int):
        req.size = node.devices
    elif inv.device_type == "cuda" and role is None:
        req.size, req.mesh = 0, [1]  # role-less helpers (prompts, advantages) run on the host CPU
        if node.replicas > MAX_UNPINNED:
            findings.append(Finding("not-enough-devices", name, f"node `{name}` asks for {node.replicas} replicas, each a "
                                    f"CPU process on the host; flowrl starts at most {MAX_UNPINNED}. Fix: lower `replicas`"))
            return None
        return req
    else:
        req.size = prod(node.mesh) if node.mesh else 1
    if req.mesh and prod(req.mesh) != req.size:
        findings.append(Finding("mesh-mismatch", name, f"node `{name}` has mesh {req.mesh} = {prod(req.mesh)} devices, but "
                                f"{req.size} {unit}(s) per replica. Fix: {_mesh_fix(req.mesh, req.size)}, or give "
                                f"{prod(req.mesh)} devices per replica"))
    req.mesh = req.mesh or [req.size]
    if req.explicit is None:
        where = f"host {hosts[0]}" if node.host else "the inventory"
        if inv.device_type == "cpu":  # processes time-share cores; one replica's ranks get distinct cores where possible
            avail = max(len(inv.host(h).visible) for h in hosts)
            need = req.size * node.replicas
            if need > PROCESSES_PER_CORE * avail:
                asked = f"{node.replicas} x {req.size} = {need}" if node.replicas > 1 else str(need)
                findings.append(Finding("not-enough-devices", name, f"node `{name}` needs {asked} processes, but "
                                        f"{where} has {avail} usable core(s) and flowrl runs at most {PROCESSES_PER_CORE} "
                                        f"processes per core. Fix: lower `devices` or `replicas` (to at most "
                                        f"{PROCESSES_PER_CORE * avail} processes), or run on a bigger machine"))
                return None
            return req
        avail = sum(len(inv.host(h).visible) for h in hosts)
        need = req.size * node.replicas
        if need > avail:
            asked = f"{node.replicas} x {req.size} = {need}" if node.replicas > 1 else str(need)
            findings.append(Finding("not-enough-devices", name, f"node `{name}` needs {asked} "
                                    f"GPUs, but {where} has {avail} visible. Fix: lower `devices` or `replicas`, "
                                    "or plan on a bigger inventory"))
            return None
    return req
