"""The inventory of a running Ray cluster: its live nodes are the hosts.

    flowrl check graphs/ppo.yaml --inventory ray                  # the cluster on this machine
    flowrl check graphs/ppo.yaml --inventory ray:10.0.0.1:6379    # a cluster's GCS address
    flowrl run graphs/ppo.yaml launcher.type=ray launcher.address=auto --inventory ray

A host is named as the Ray launcher names it (flowrl/ray_cluster.py: `NodeName`, made unique with
the node id), so a plan made here pins each process to the Ray node it names. Ray says how many CPUs
and GPUs a node offers, not which: CPU hosts get cores 0..CPU-1, GPU hosts GPUs 0..GPU-1 (named by
Ray's `accelerator_type:*` resource; memory and topology unknown, so the rules that need them stay
quiet). When any node has GPUs, nodes without GPUs (a CPU head) are left out; the header says so.
Custom resources (`ray start --resources '{"host_a": 1}'`) are kept per host in `resources`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flowrl.graph.errors import Problem
from flowrl.placement.cpu import cpu_host
from flowrl.placement.devices import Device, Host, Inventory
from flowrl.placement.errors import InventoryError


def _gpu_host(node) -> Host:
    kind = next((k.split(":", 1)[1] for k in node.resources if k.startswith("accelerator_type:")), "")
    devices = {i: Device(host=node.name, id=i, type="cuda", name=kind) for i in range(node.gpus)}
    return Host(name=node.name, address=node.address, devices=devices, visible=list(devices))


@dataclass
class RayInventory(Inventory):
    """Hosts, CPUs, GPUs and custom resources of the live nodes of a Ray cluster."""

    resources: dict[str, dict] = field(default_factory=dict)
    """Host name -> its custom Ray resources (without CPU, GPU, memory, node:*)."""

    @classmethod
    def from_nodes(cls, nodes, address: str) -> "RayInventory":
        """From `flowrl.ray_cluster.RayNode`s (what `RayCluster.nodes()` returns)."""
        from flowrl.ray_cluster import START_HINT

        if not nodes:
            raise InventoryError([Problem("", f"the Ray cluster at {address!r} has no live node",
                                          f"start one: {START_HINT}", "ray")])
        has_gpus = any(n.gpus for n in nodes)
        hosts, left_out = [], []
        for n in nodes:
            if (has_gpus and not n.gpus) or (not has_gpus and n.cpus < 1):
                left_out.append(n.name)  # a CPU head in a GPU cluster; a node that offers no CPU to tasks
                continue
            hosts.append(_gpu_host(n) if has_gpus else cpu_host(n.name, n.address, list(range(n.cpus))))
        if not hosts:
            raise InventoryError([Problem("", f"no node of the Ray cluster at {address!r} offers a CPU or GPU",
                                          "start nodes with --num-cpus / --num-gpus above 0", "ray")])
        custom = {n.name: n.custom for n in nodes if n.custom}
        source = f"Ray cluster {address}"
        if left_out:
            source += f" (left out, no {'GPU' if has_gpus else 'CPU'}: {', '.join(left_out)})"
        if custom:
            source += "; custom resources: " + ", ".join(f"{h} {r}" for h, r in custom.items())
        return cls(hosts=hosts, device_type="cuda" if has_gpus else "cpu", source=source, resources=custom)

    @classmethod
    def probe(cls, address: str | None = None) -> "RayInventory":
        """Join the cluster at `address` (default `auto`), read its nodes, and leave it again
        (when this process was not connected before)."""
        from flowrl.ray_cluster import RayCluster, RayClusterError

        address = address or "auto"
        try:
            cluster = RayCluster.connect(address)
        except RayClusterError as e:
            raise InventoryError([Problem("", str(e), "", "ray")]) from None
        try:
            return cls.from_nodes(cluster.nodes(), address)
        finally:
            cluster.close()

