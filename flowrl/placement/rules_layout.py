"""Layout across nodes and hosts: dtypes on edges, torchrun rank layout of multi-host groups.

Two mistakes that otherwise surface late and far from their cause (seeds 6 and 7):
- nodes joined by an edge computing in different dtypes fail mid-run with `expected scalar type
  Half but found Float`; a graph says so at check time;
- a group spread over hosts must look like torchrun's layout: the same number of processes on
  every host (`--nproc_per_node`) and ranks host by host (RANK = node_rank * nproc + LOCAL_RANK).
  Otherwise ranks disagree about who is who and hang at the first barrier.
"""

from __future__ import annotations

from flowrl.graph.spec import GraphSpec
from flowrl.placement.devices import Inventory
from flowrl.placement.findings import Finding
from flowrl.placement.requests import Request


def _dtypes(spec: GraphSpec) -> list[Finding]:
    out = []
    for edge in spec.edges:
        a, b = spec.nodes[edge.src].dtype, spec.nodes[edge.dst].dtype
        if a != b:
            out.append(Finding("dtype-mismatch", edge.dst,
                               f"edge {edge}: `{edge.src}` computes in {a} but `{edge.dst}` in {b}; the tensors it carries "
                               f"would fail mid-run (`expected scalar type ... but found ...`). Fix: give both nodes the "
                               f"same `dtype:` (e.g. `dtype: {a}` on `{edge.dst}`)"))
    return out


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
    if per_host % mesh[-1]:
        return [Finding("tp-across-hosts", req.name,
                        f"node `{req.name}` replica {r} has {per_host} processes per host but its innermost mesh "
                        f"dimension is {mesh[-1]} (mesh {mesh}); tensor-parallel groups would cross hosts and run at "
                        f"network speed. Fix: make the last mesh dimension divide {per_host}", ids)]
    return []


def check(spec: GraphSpec, inv: Inventory, reqs: dict[str, Request]) -> list[Finding]:
    out = _dtypes(spec)
    for req in reqs.values():
        for r, group in enumerate(req.placed):
            found = _hosts(req, r, group, req.mesh)
            out += found
            if found:
                break  # one finding per node is enough; the replicas share the cause
    return out
