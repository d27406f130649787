"""A machine without GPUs: its CPU cores are the devices.

    inv = CpuInventory.probe()     # cores this process may run on (os.sched_getaffinity)

Cores are time-shared by design: on a 2-core laptop or CI runner every node of `graphs/ppo.yaml`
still gets a process, pinned to a core with `os.sched_setaffinity`, several to a core. So sharing
is a note here, never an error. Core ids need no remapping: the id a graph names is the core the
process is pinned to.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from flowrl.placement.devices import Device, Host, Inventory


def usable_cores() -> list[int]:
    """Cores this process may run on (respects taskset / cgroup cpusets), sorted."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS has no sched_getaffinity
        return list(range(os.cpu_count() or 1))


def cpu_host(name: str, address: str, cores: list[int], all_cores: list[int] | None = None) -> Host:
    """A host whose devices are CPU cores; `cores` are the usable ones (others exist but are hidden)."""
    present = sorted(set(all_cores or cores) | set(cores))
    devices = {c: Device(host=name, id=c, type="cpu", name="cpu") for c in present}
    return Host(name=name, address=address, devices=devices, visible=list(cores))


@dataclass
class CpuInventory(Inventory):
    """This machine's CPU cores."""

    @classmethod
    def probe(cls) -> "CpuInventory":
        cores = usable_cores()
        host = cpu_host("localhost", "127.0.0.1", cores, list(range(os.cpu_count() or len(cores))))
        return cls(hosts=[host], device_type="cpu", source="CPU cores (no GPU found)")
