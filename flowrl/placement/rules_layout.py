"""Layout across hosts: torchrun rank layout of multi-host groups, tensor parallelism kept in a host.

- a group spread over hosts must look like torchrun's layout: the same number of processes on
  every host (`--nproc_per_node`) and ranks host by host (RANK = node_rank * nproc + LOCAL_RANK).
  Otherwise ranks disagree about who is who and hang at the first barrier (seed 7);
- a mesh `[..., t]` with t > 1 declares tensor parallelism over its last dimension; a tensor group
  that crosses hosts runs every layer's all-reduce at network speed. A flat group (`mesh: [N]`, or
  none) is data parallel / FSDP, which spans hosts by design (verl's default): no finding.
"""

from __future__ import annotations

from math import gcd

from flowrl.graph.spec import GraphSpec
from flowrl.placement.devices import Inventory
from flowrl.placement.findings import Finding
from flowrl.placement.requests import Request


def _hosts(req: Request, r: int, group, mesh: list[int]) -> list[Finding]:
    order = [d.host for d in group]
    hosts = list(dict.fromkeys(order))
    if len(hosts) < 2:
        return []
    counts = {h: order.count(h) for h in hosts}
    listing = ", ".join(f"{h}: {n}" for h, n in counts.items())
    ids: tuple[int, ...] = ()  # the message names host:id pairs; bare ids would be ambiguous
    if len(set(counts.values())) > 1:
        return [Finding("rank-layout", req.name,
                        f"node `{req.name}` replica {r} spans hosts with unequal process counts ({listing}); torchrun "
                        "runs the same --nproc_per_node on every host, so ranks would not line up. Fix: give it the "
                        "same number of devices on each host", ids)]
    contiguous = [h for i, h in enumerate(order) if i == 0 or order[i - 1] != h]
    if len(contiguous) != len(hosts):
        fixed = [f"{d.host}:{d.id}" for h in hosts for d in group if d.host == h]
        return [Finding("rank-layout", req.name,
                        f"node `{req.name}` replica {r} lists devices alternating between hosts ({' '.join(order)}); "
                        "ranks must run host by host (RANK = node_rank * nproc_per_node + LOCAL_RANK) or ranks hang "
                        f"at the first barrier. Fix: list devices host by host: {fixed}", ids)]
    per_host = counts[hosts[0]]
    tp = mesh[-1]
    if len(mesh) > 1 and tp > 1 and per_host % tp:
        keep = gcd(tp, per_host)  # the largest tensor size <= the one asked for that stays in a host
        fixed = [*mesh[:-2], mesh[-2] * (tp // keep), keep]
        return [Finding("tp-across-hosts", req.name,
                        f"node `{req.name}` replica {r} has {per_host} processes per host but its tensor-parallel "
                        f"(last) mesh dimension is {tp} (mesh {mesh}); tensor groups would cross hosts and run every "
                        f"layer's all-reduce at network speed. Fix: use mesh {fixed}, so each tensor group of {keep} "
                        "stays inside a host", ids)]
    return []


def _network(req: Request, r: int, group, inv: Inventory, local: bool) -> Finding | None:
    """Where a group that spans hosts meets: its store on rank 0's host address, and the interface
    each host's ranks use (known only for this machine's addresses)."""
    from flowrl.placement.network import interface_of

    hosts = list(dict.fromkeys(d.host for d in group))
    if len(hosts) < 2:
        return None
    backend = "NCCL" if group[0].type == "cuda" else "gloo"
    var = "NCCL_SOCKET_IFNAME" if backend == "NCCL" else "GLOO_SOCKET_IFNAME"
    parts = []
    for h in hosts:
        ranks = [i for i, d in enumerate(group) if d.host == h]
        address = inv.host(h).address
        name = interface_of(address) if local or address.startswith("127.") else None
        where = f"interface {name}" if name else "cannot tell from here (set at start there to the interface holding " \
            "it; set " + var + " if that host routes elsewhere)"
        parts.append(f"{h} ranks {ranks[0]}-{ranks[-1]} at {address}: {where}")
    return Finding("group-network", req.name,
                   f"node `{req.name}` replica {r} spans {len(hosts)} hosts: its store listens on {hosts[0]} "
                   f"({inv.host(hosts[0]).address}, rank 0's host, sealed by the run's secret), {backend} on: "
                   + "; ".join(parts) + ". Each host must reach the others' addresses (flowrl fails at start naming "
                   "both hosts if not)")


def check(spec: GraphSpec, inv: Inventory, reqs: dict[str, Request]) -> list[Finding]:
    from flowrl.placement.cpu import CpuInventory
    from flowrl.placement.nvml import NvmlInventory

    local = isinstance(inv, (CpuInventory, NvmlInventory))
    out: list[Finding] = []
    for req in reqs.values():
        for group in req.placed:
            net = _network(req, req.placed.index(group), group, inv, local)
            if net is not None:
                out.append(net)
                break  # the replicas share the layout
        for r, group in enumerate(req.placed):
            found = _hosts(req, r, group, req.mesh)
            out += found
            if found:
                break  # one finding per node is enough; the replicas share the cause
    return out
