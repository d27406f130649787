"""Is each group a good group of cards: equal memory, NVLink inside, one PCIe root, bf16-capable.

Topology is judged against the host, not against what happens to be left: a group gets
`nvlink-missed` when the host has a group of that size with more NVLink links, and `pcie-split`
when it spans PCIe root complexes without full NVLink although one root has enough GPUs. The fix
names free GPUs that would do better when there are some, else the better group and its users
(swapping device lists between nodes is then the fix).
"""

from __future__ import annotations

from itertools import combinations
from math import comb

from flowrl.graph.spec import GraphSpec
from flowrl.placement.devices import Device, Inventory
from flowrl.placement.findings import Finding, ids_text
from flowrl.placement.groups import EXHAUSTIVE_LIMIT, best_on_host, mem_class, nvlink_links
from flowrl.placement.requests import Request


def _most_links(devs: list[Device], size: int) -> list[Device]:
    """A group of `size` from `devs` with the most NVLink links (greedy above the search limit)."""
    key = (tuple(devs), size)
    if key not in _MOST_LINKS:
        if len(_MOST_LINKS) > 256:
            _MOST_LINKS.clear()
        _MOST_LINKS[key] = _search_links(devs, size)
    return _MOST_LINKS[key]


_MOST_LINKS: dict[tuple, list[Device]] = {}  # one search per (device set, size), not one per replica


def _search_links(devs: list[Device], size: int) -> list[Device]:
    if comb(len(devs), size) <= EXHAUSTIVE_LIMIT:
        return list(max(combinations(devs, size), key=lambda g: (nvlink_links(list(g)), [-d.id for d in g])))
    return best_on_host(devs, size, {})


def _parts(group: list[Device]) -> dict[str, list[Device]]:
    out: dict[str, list[Device]] = {}
    for d in group:
        out.setdefault(d.host, []).append(d)
    return out


def _fix(better: list[Device], spare: list[Device], k: int, links: int, owners) -> str:
    """Name spare (own + unused) GPUs that beat the current group, else the better group's users."""
    if len(spare) >= k:
        alt = _most_links(spare, k)
        if nvlink_links(alt) > links:
            return f"Fix: use devices {[d.id for d in alt]}"
    users = sorted({n for d in better for n in owners.get((d.host, d.id), ())})
    held = f" (now used by {', '.join(users)})" if users else ""
    return f"Fix: rearrange the device lists so this group gets GPUs like {[d.id for d in better]}{held}"


def _topology(req: Request, r: int, part: list[Device], inv: Inventory, owners, where: str) -> list[Finding]:
    k, links = len(part), nvlink_links(part)
    ids = [d.id for d in part]
    host = part[0].host
    mine = set(ids)
    visible = inv.host(host).visible_devices()
    spare = [d for d in visible if d.id in mine or not owners.get((host, d.id), set()) - {req.name}]
    if links == k * (k - 1) // 2:
        return []  # fully NVLink-connected: nothing can beat it, and PCIe roots do not matter
    if any(d.nvlink_peers for d in visible):
        best = _most_links(visible, k)
        if nvlink_links(best) > links:
            return [Finding("nvlink-missed", req.name,
                            f"node `{req.name}` replica {r}: GPUs {ids_text(ids)}{where} have {links} NVLink link(s) "
                            f"among them, but GPUs {ids_text([d.id for d in best])} have {nvlink_links(best)}; without "
                            f"NVLink its {k} ranks exchange tensors over PCIe. {_fix(best, spare, k, links, owners)}",
                            tuple(ids), host)]
    roots = sorted({d.pcie_root for d in part if d.pcie_root is not None})
    if len(roots) > 1 and links < k * (k - 1) // 2:
        by_root: dict[str, list[Device]] = {}
        for d in visible:
            by_root.setdefault(d.pcie_root or "", []).append(d)
        roomy = [(root, devs) for root, devs in by_root.items() if root and len(devs) >= k]
        if roomy:
            root, devs = roomy[0]
            spare_roots = [[d for d in spare if d.pcie_root == x] for x, _ in roomy]
            fit = next((g for g in spare_roots if len(g) >= k), None)
            fix = (f"use devices {[d.id for d in best_on_host(fit, k, {})]}" if fit else
                   f"rearrange the device lists so this group stays under one root (e.g. GPUs {ids_text([d.id for d in devs])})")
            return [Finding("pcie-split", req.name,
                            f"node `{req.name}` replica {r}: GPUs {ids_text(ids)}{where} span PCIe root complexes "
                            f"{', '.join(roots)} and are not all NVLink-connected, so their traffic crosses the CPU "
                            f"interconnect; root {root} alone holds {len(devs)} GPUs. Fix: {fix}", tuple(ids), host)]
    return []


def check(spec: GraphSpec, inv: Inventory, reqs: dict[str, Request]) -> list[Finding]:
    if inv.device_type != "cuda":
        return []
    out: list[Finding] = []
    used: dict[tuple[str, int], set[str]] = {}
    for req in reqs.values():
        for group in req.placed:
            for d in group:
                used.setdefault((d.host, d.id), set()).add(req.name)
    for req in reqs.values():
        dtype = spec.nodes[req.name].dtype
        old = sorted({d for g in req.placed for d in g if d.compute_capability and d.compute_capability < (8, 0)},
                     key=lambda d: d.id)
        if dtype == "bfloat16" and old:
            cc = ".".join(map(str, old[0].compute_capability))
            out.append(Finding("bf16-unsupported", req.name,
                               f"node `{req.name}` computes in bfloat16 on {old[0].label()}, compute capability {cc}; "
                               "bfloat16 needs compute capability 8.0 or newer (A100, H100, L40S, RTX 30xx+). Fix: use "
                               "`dtype: float16` or `float32` for this node, or place it on newer GPUs",
                               tuple(d.id for d in old), old[0].host))
        mixed = [(r, g) for r, g in enumerate(req.placed) if len({mem_class(d) for d in g if d.memory_bytes}) > 1]
        if mixed:
            r, g = mixed[0]
            sizes = ", ".join(f"{d.id}: {d.memory_gib:.0f} GiB" for d in g if d.memory_gib)
            small = min(d.memory_gib for d in g if d.memory_gib)
            out.append(Finding("mixed-memory", req.name,
                               f"node `{req.name}` replica {r} mixes GPU memory sizes ({sizes}); every rank of a group "
                               f"holds the same shard, so all are limited to {small:.0f} GiB. Fix: group cards of equal "
                               "memory (e.g. all 40 GiB or all 80 GiB)", tuple(d.id for d in g), g[0].host))
        for r, group in enumerate(req.placed):
            for host, part in _parts(group).items():
                if len(part) < 2:
                    continue
                out += _topology(req, r, part, inv, used, f" on {host}" if inv.multi_host else "")
    return out
