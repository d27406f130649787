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


def check(spec: GraphSpec, inv: Inventory, reqs: dict[str, Request]) -> list[Finding]:
    out: list[Finding] = []
    for req in reqs.values():
        for r, group in enumerate(req.placed):
            found = _hosts(req, r, group, req.mesh)
            out += found
            if found:
                break  # one finding per node is enough; the replicas share the cause
    return out
