"""A lost host: its node processes move to the hosts that are left, or the run fails naming it.

    why = move_off("host-b", launcher=launcher, procs=procs, spec=spec, classes=classes, net=net,
                   ledger=ledger, report=report)   # None: moved (restart them); else the failure text

The controller calls this when a process it restarts sat on a host the launcher reports lost (a
Ray node that left the cluster). Every process of that host moves at once, re-planned by the
planner on the cluster as it is now (`launcher.inventory()`): the graph's own placement with the
lost host's nodes unpinned (`host:` dropped), so the planner puts them where they fit. Only the
moved processes take the new plan's entries; everyone else stays where it runs.

What moves with a process: its host, devices (cores or GPUs on the new host) and environment; its
input addresses are decided again (addresses.py: a port whose producers now share its host goes
back to ipc, one fed from another host binds tcp on the new host's address); its CURVE keys stay,
so consumers that admit it still do. When a moved consumer reports READY at its new address the
controller tells every producer to connect there and leave the old one (`Wiring.on_bound`).
The move is recorded as a `replanned` event in the ledger and shown in the live view, and
RUN_DIR/plan.json is rewritten with the moved entries (a `plan` event, planfile.py).
"""

from __future__ import annotations

import logging

from flowrl.runtime.protocol.ledger import Replanned

log = logging.getLogger("flowrl.replan")


def move_off(lost: str, *, launcher, procs, spec, classes: dict, net, ledger, report=None,
             relink=None, planfile=None) -> str | None:
    """Move every process of host `lost` (procs: the process table; net: the run's addresses, where
    the moved processes are placed again; report: the run's report, told of the move; relink: gives
    a data-parallel replica's ranks their shard channels again, `Wiring.relink_ranks`; planfile:
    RUN_DIR/plan.json, rewritten with the moved entries). A replica with a rank there is planned
    again whole: its ranks restart together anyway, and its layout (rank 0's host, each rank's
    cores) comes from one plan. Returns None, or why the run must fail."""
    from flowrl.placement import make_plan

    gone = launcher.lost_node(lost)
    table = list(procs)
    hit = {(p.spec.node, p.spec.replica) for p in table if p.spec.host == lost}
    procs = [p for p in table if (p.spec.node, p.spec.replica) in hit]
    if not procs:  # moved already
        return None
    where = f"Ray node {lost!r} ({gone.address}, node id {gone.node_id[:8]}) is gone"
    nodes = sorted({p.spec.node for p in procs})
    try:
        inventory = launcher.inventory()
    except Exception as e:  # noqa: BLE001 - no host left, or the cluster cannot be read
        return f"{where}, and its processes cannot be re-planned: {str(e).splitlines()[0]}"
    wanted = spec.model_copy(deep=True)
    for name in nodes:
        wanted.nodes[name].host = None
    plan = make_plan(wanted, inventory, classes)
    errors = [f for f in plan.errors if f.node in nodes or not f.node]
    fresh = {(e.node, e.replica, e.rank): e for e in plan.entries}
    missing = [p.id for p in procs if (p.spec.node, p.spec.replica, p.spec.rank) not in fresh]
    if errors or missing:
        first = errors[0] if errors else None
        reason = f"{first.code}: {first.message}" if first else f"no place for {', '.join(missing)}"
        return (f"{where}, and its processes ({', '.join(p.id for p in procs)}) fit on no host that is left "
                f"({', '.join(h.name for h in inventory.hosts)}): {reason}. Fix: add a host to the cluster and "
                "resume the run (flowrl run --resume RUN_DIR)")
    moved = {}
    for p in procs:
        e = fresh[(p.spec.node, p.spec.replica, p.spec.rank)]
        ps = p.spec
        if ps.host == lost or e.host != ps.host:
            moved[p.id] = e.host
        ps.host, ps.devices = e.host, list(e.devices)
        ps.cpu_cores = list(e.local_devices) if e.device_type == "cpu" else []
        net.place(p.id, launcher.host_address(e.host))
        ps.host_address = net.where[p.id]
    ports: dict[tuple, int] = {}
    for p in procs:  # a replica's group: its store on rank 0's (new) host, at a port free there
        ps = p.spec
        e = fresh[(ps.node, ps.replica, ps.rank)]
        master = net.where.get(f"{ps.node}/{ps.replica}/0", e.master_addr)
        if (ps.node, ps.replica) not in ports:
            ports[ps.node, ps.replica] = launcher.free_port(master) if ps.world_size > 1 else 0
        ps.env = dict(plan.env_for(e, master_port=ports[ps.node, ps.replica]))
        if ps.world_size > 1:
            ps.env["MASTER_ADDR"] = master
    if relink is not None:
        for node, replica in sorted(hit):
            relink([p for p in table if (p.spec.node, p.spec.replica) == (node, replica)])
    for p in procs:  # addresses after every move: a port's producers may have moved with it
        ps = p.spec
        for port in ps.inputs:
            ps.inputs[port] = net.input_address(ps.node, ps.replica, port)
        ps.input_clients = {port: k for port in ps.inputs
                            for k in [net.input_clients(ps.node, ps.replica, port)] if k is not None}
        ps.control, ps.control_key = net.control_address(p.id), net.control_key(p.id)
    ledger.record(Replanned(host=lost, moved=moved))
    if planfile is not None:  # the moved processes' entries replace theirs in plan.json
        keys = {(p.spec.node, p.spec.replica, p.spec.rank) for p in procs}
        planfile.plan.entries = [fresh[k] if k in keys else e for e in planfile.plan.entries
                                 for k in [(e.node, e.replica, e.rank)]]
        planfile.changed(f"host {lost} lost", moved=moved)
    text = f"{lost} lost: " + ", ".join(f"{pid} -> {host}" for pid, host in sorted(moved.items()))
    log.warning("re-planned: %s", text)
    if report is not None:
        report.replanned(lost, moved, text)
    return None
