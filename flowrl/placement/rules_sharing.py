"""Who shares a device with whom: overlapping groups and GPUs busy with other jobs.

The rules from the field (seeds 3 and 4):
- actor and critic never share a GPU (both train at once, each needs the card's memory);
- reference and reward may share with each other (forward passes only), not with actor or critic;
- any other undeclared sharing of a GPU is worth a warning; `colocate_with` declares it intended;
- a GPU already used by a foreign job slows both down (a warning); the memory that job holds counts
  against what the plan may put there. It is an OOM waiting to happen (an error) when what is left
  is less than the plan puts there (the memory model's estimate, the larger turn for nodes that
  take turns; half the card without one), and for a trainer already when its GPU would be more
  than 90% full: the other job's use is a snapshot and grows, a trainer's peaks do too. A process
  under 256 MiB (an MPS daemon) does not make a GPU busy.
On a CPU-only machine cores are time-shared by design: sharing is only a note.
"""

from __future__ import annotations

from itertools import combinations

from flowrl.graph.spec import GraphSpec
from flowrl.placement.devices import GIB, Inventory
from flowrl.placement.memory import HEADROOM
from flowrl.placement.findings import Finding, ids_text
from flowrl.placement.requests import Request, colocated

TRAINERS = {"actor", "critic"}
FORWARD_ONLY = {"reference", "reward"}


def forbidden(role_a: str | None, role_b: str | None) -> bool:
    """Pairs that must be disjoint unless colocation is declared."""
    if role_a in TRAINERS and role_b in TRAINERS:
        return True
    return (role_a in FORWARD_ONLY and role_b in TRAINERS) or (role_b in FORWARD_ONLY and role_a in TRAINERS)


def _why(role_a, role_b) -> str:
    if role_a in TRAINERS and role_b in TRAINERS:
        return "both train at the same time and each needs the whole card's memory"
    return ("its forward passes compete with training for memory and bandwidth "
            "(the classic OOM while nvidia-smi shows 40% use)")


def _named(name: str, reqs: dict[str, Request]) -> str:
    role = reqs[name].role
    return f"`{name}`" + (f" ({role})" if role and role != name else "")


def _owners(reqs: dict[str, Request]) -> dict[tuple[str, int], list[str]]:
    out: dict[tuple[str, int], list[str]] = {}
    for req in reqs.values():
        for group in req.placed:
            for d in group:
                names = out.setdefault((d.host, d.id), [])
                if req.name not in names:
                    names.append(req.name)
    return out


def check(spec: GraphSpec, inv: Inventory, reqs: dict[str, Request], loads: dict | None = None) -> list[Finding]:
    """`loads`: (host, id) -> DeviceLoad from the memory model (flowrl/placement/turns.py; decides
    when busy is an error)."""
    out: list[Finding] = []
    owners = _owners(reqs)
    if inv.device_type == "cpu":
        return _cpu_shared(reqs, inv)
    free = {h.name: [p for p in h.visible if (h.name, p) not in owners] for h in inv.hosts}
    pairs: dict[tuple[str, str, str], list[int]] = {}
    for (host, dev), names in owners.items():
        for a, b in combinations(names, 2):
            pairs.setdefault((a, b, host), []).append(dev)
    for (a, b, host), devs in pairs.items():
        ra, rb = reqs[a].role, reqs[b].role
        if reqs[a].short or reqs[b].short or colocated(spec, a, b) or {ra, rb} <= FORWARD_ONLY:
            continue  # scarcity was reported already; declared sharing is intended; ref + reward is fine
        where = f" on {host}" if inv.multi_host else ""
        second, first = (a, b) if ra in FORWARD_ONLY or (rb in TRAINERS and ra not in TRAINERS) else (b, a)
        spare = f" (free{where}: {ids_text(free[host])})" if free[host] else ""
        fix = (f"Fix: give them disjoint devices{spare}, or declare "
               f"`colocate_with: [{first}]` on `{second}` if sharing is intended")
        if forbidden(ra, rb):
            out.append(Finding("overlap-forbidden", second,
                               f"node {_named(second, reqs)} shares GPU(s) {ids_text(devs)}{where} with {_named(first, reqs)}: "
                               f"{_why(reqs[second].role, reqs[first].role)}. {fix}", tuple(sorted(devs)), host))
        else:
            out.append(Finding("overlap", second, f"nodes `{first}` and `{second}` both use GPU(s) {ids_text(devs)}{where} "
                               f"without declaring it; they will compete for its memory. {fix}", tuple(sorted(devs)), host))
    for req in reqs.values():
        busy = sorted({d for group in req.placed for d in group if d.busy}, key=lambda d: d.id)
        if not busy:
            continue
        host = inv.host(busy[0].host)
        idle = [d.id for d in host.visible_devices() if not d.busy]
        procs = "; ".join(f"GPU {d.id}: {', '.join(p.describe() for p in d.processes)}" for d in busy)
        short = _short_of_memory(busy, loads or {}, req.role in TRAINERS)
        if short:
            d, free, load = short
            need = load.total if load else 0
            planned = f"{load.text(foreign=False)} = {need / GIB:.1f} GiB" if load and len(load.nodes) > 1 else \
                f"{need / GIB:.1f} GiB"
            verdict = (f"GPU {d.id} has {free / GIB:.1f} GiB left of {d.memory_gib:.0f} GiB"
                       + (f" and the plan puts {planned} there" if need else ", less than half the card")
                       + ("; it would run out of memory" if need > free or not need else
                          f"; the trainer would leave less than {HEADROOM:.0%} of the card for its peaks and the "
                          "other job's growth, and run out of memory"))
        else:
            verdict = "there is memory left for the plan, but both jobs will slow each other down"
        out.append(Finding("device-busy", req.name,
                           f"node `{req.name}` is planned on GPU(s) already used by another job ({procs}); {verdict}. "
                           f"Fix: pick idle GPUs (idle: {ids_text(idle)}), or stop that job first",
                           tuple(d.id for d in busy), host.name, severity="error" if short else "warning"))
    return out


def _short_of_memory(busy, loads: dict, trainer: bool) -> tuple | None:
    """The first busy GPU where what the plan puts does not fit in what the other job left (the
    memory model's estimate; half the card when there is none), or for a trainer leaves under
    HEADROOM of the card: (device, free bytes, DeviceLoad or None)."""
    for d in busy:
        if not d.memory_bytes:
            continue
        free = d.memory_bytes - d.foreign_bytes
        load = loads.get((d.host, d.id))
        need = load.total if load else 0
        limit = free - HEADROOM * d.memory_bytes if trainer else free
        if (need and need > limit) or (not need and free < d.memory_bytes / 2):
            return d, free, load
    return None


def _cpu_shared(reqs: dict[str, Request], inv: Inventory) -> list[Finding]:
    """One note for all time-shared cores of a host (never one per core)."""
    procs: dict[tuple[str, int], list[str]] = {}
    for req in reqs.values():
        for group in req.placed:
            for d in group:
                procs.setdefault((d.host, d.id), []).append(req.name)
    out = []
    for host in inv.hosts:
        shared = {core: names for (h, core), names in sorted(procs.items()) if h == host.name and len(names) > 1}
        if not shared:
            continue
        parts = "; ".join(f"core {c}: {len(n)} ({', '.join(dict.fromkeys(n))})" for c, n in list(shared.items())[:16])
        more = f"; and {len(shared) - 16} more cores" if len(shared) > 16 else ""
        where = f" on {host.name}" if inv.multi_host else ""
        out.append(Finding("cpu-shared", None, f"{len(shared)} core(s){where} are time-shared by several node processes "
                           f"({parts}{more}); fine for a CPU run, slower than one core each", tuple(shared), host.name))
    return out
