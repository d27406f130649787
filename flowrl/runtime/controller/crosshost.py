"""`flowrl scale` on a run that spans hosts: where a new replica goes, and whose keys are admitted.

    entries, why = place_replicas(wiring, "rollout", 2)   # why: None, or the refusal's text
    await admit(wiring, procs, send, "rollout/1/0")         # before it starts: control + its consumers
    await admit(wiring, procs, send, "rollout/1/0", add=False)   # removed: its key is refused again

Placement: on the launcher's live inventory (under Ray, the cluster's nodes as they are now), a
device a process of the run already has counts as used; a new replica goes to the host with the
most free devices of its kind (ties: the inventory's order). With no free device anywhere, CPU
cores are time-shared as the planner does: the host whose cores carry the least CPU weight
(planner.CPU_WEIGHT), on its least loaded cores; GPUs are refused. It must be a host it can reach
its consumers from: a consumer on another host must already take that input over tcp (a running
consumer cannot move its ipc input), and a host other than the controller's needs the tcp control
(bound when the run started on several hosts). A node pinned with `host:` stays on its host. No
host with room: the refusal names every host and what it has.

Keys (docs/multi-host.md): a new process gets its own CURVE key pair (`Network.place`). Before it
starts, the control's ZAP set admits its public key, and every running consumer whose CURVE input
it will send into gets an `Admit` order (the consumer's ZAP set takes the key; its spec keeps it
for a restart). Its own inputs admit their producers' keys as every process's do; its producers
reach it through `Connect` with its address and server key once it has bound (`Wiring.on_bound`).
A removed process's key is revoked the same way (a connection already made stays until it drops,
so it can still hand its last messages over while it stops).
"""

from __future__ import annotations

from collections import defaultdict

from flowrl.runtime.protocol import messages as m
from flowrl.runtime.protocol.addresses import SERVE_PORT, admit_control


def place_replicas(wiring, node: str, replicas: int):
    """Plan entries for replicas `old..replicas-1` of `node` on hosts with free devices (CPU cores:
    else time-shared on the least loaded host); returns (entries, None) or ([], why)."""
    from dataclasses import replace

    from flowrl.placement.planner import cpu_weight

    spec = wiring.spec
    old = spec.nodes[node].replicas
    template = sorted((e for e in wiring.plan.entries if e.node == node and e.replica == 0), key=lambda e: e.rank)
    need = sum(len(e.devices) for e in template)
    kind = template[0].device_type
    try:
        inventory = wiring.launcher.inventory()
    except NotImplementedError:
        from flowrl.placement import get_inventory

        inventory = get_inventory(wiring.facts.inventory)
    load: dict[tuple, float] = defaultdict(float)  # (host, device) -> the CPU weights of the processes on it
    for e in wiring.plan.entries:
        for d in e.devices:
            load[e.host, d] += cpu_weight(wiring.classes.get(e.node))
    weight = cpu_weight(wiring.classes.get(node))
    out = []
    for r in range(old, replicas):
        free_best, shared_best, rows = None, None, []
        for h in inventory.hosts:
            devices = [d for d in h.visible_devices() if d.type == kind]
            free = [d for d in devices if (h.name, d.id) not in load]
            blocked = _blocked(wiring, node, h, spec.nodes[node].host)
            rows.append(f"{h.name}: {len(free)} of {len(devices)} {kind} device(s) free" + (f" ({blocked})" if blocked else ""))
            if blocked or len(devices) < need:
                continue
            if len(free) >= need and (free_best is None or len(free) > len(free_best[1])):
                free_best = (h, free)
            least = sorted(devices, key=lambda d: load.get((h.name, d.id), 0.0))[:need]
            cost = sum(load.get((h.name, d.id), 0.0) for d in least) + sum(load.get((h.name, d.id), 0.0) for d in devices)
            if shared_best is None or cost < shared_best[0]:
                shared_best = (cost, h, least)
        if free_best is None and (kind != "cpu" or shared_best is None):
            return [], (f"no host has room for {node}/{r} ({need} free {kind} device(s); a device a process of the run "
                        f"has counts as used): {'; '.join(rows)}. Fix: add a host to the cluster, or free devices")
        host, chosen = (free_best[0], free_best[1][:need]) if free_best else shared_best[1:]  # CPU: time-shared
        for d in chosen:
            load[host.name, d.id] += weight
        for e in template:
            ids = [d.id for d in chosen][sum(len(t.devices) for t in template[:e.rank]):][:len(e.devices)]
            local = list(range(len(ids))) if kind == "cuda" else ids
            out.append(replace(e, replica=r, host=host.name, devices=ids, local_devices=local, master_addr=host.address,
                               master_port=None, visible_devices=ids if kind == "cuda" else []))
    return out, None


def _blocked(wiring, node: str, host, pinned: str | None) -> str | None:
    """Why a new replica of `node` cannot run on `host` while the run goes on (None: it can)."""
    net = wiring.net
    if pinned and host.name != pinned:
        return f"{node} is pinned to {pinned}"
    if host.address != net.controller_address and net.control_tcp is None:
        return "the run's control is on its one host only"
    for dst, port in _consumers(wiring.spec, node):
        for rr in range(wiring.spec.nodes[dst].replicas):
            where = net.where.get(f"{dst}/{rr}/0")
            if where not in (None, host.address) and not wiring.address(dst, rr, port).startswith("tcp://"):
                return f"{dst}/{rr} on another host takes its input over ipc"
    return None


def _consumers(spec, node: str) -> list[tuple[str, str]]:
    """(consumer node, input port) of every edge and service `node` sends into."""
    return ([(e.dst, e.dst_port) for e in spec.edges if e.src == node]
            + [(s.dst, SERVE_PORT) for s in spec.services if s.src == node])


async def admit(wiring, procs, send, proc_id: str, *, add: bool = True) -> None:
    """Admit (or, `add=False`, refuse) process `proc_id`'s public key at the control and at every
    CURVE input it sends into; running consumers are told with `Admit`, their specs keep it."""
    net = wiring.net
    if proc_id not in net.keys:
        return
    key = net.keys[proc_id][0]
    admit_control(net, **({"add": [key]} if add else {"remove": [key]}))
    for dst, port in _consumers(wiring.spec, proc_id.split("/")[0]):
        for proc in procs.of_node(dst):
            clients = proc.spec.input_clients.get(port)
            if proc.spec.rank != 0 or clients is None:
                continue  # an ipc input, or one without CURVE: nothing to admit
            keys = (set(clients) | {key}) if add else (set(clients) - {key})
            proc.spec.input_clients[port] = sorted(keys)
            await send(proc, m.Admit(port=port, **({"add": [key]} if add else {"remove": [key]})))
