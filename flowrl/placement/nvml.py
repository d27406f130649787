"""The GPUs of this machine, as NVML reports them (nvidia-ml-py), seen through CUDA_VISIBLE_DEVICES.

    inv = NvmlInventory.probe()          # None when there is no driver or no GPU

NVML indices are PCI bus order, i.e. physical ids. Topology comes from two NVML queries:
`nvmlDeviceGetTopologyCommonAncestor` for every pair (devices whose nearest common ancestor is at
most a host bridge share a PCIe root complex; at most a NUMA node share a NUMA node), and each
NVLink's state and remote PCI address (a remote that is not a GPU is an NVSwitch: every GPU on
the switch fabric reaches every other). Optional queries that a driver does not support leave
the field unknown instead of failing the inventory.

Tests stand in for the driver by monkeypatching the `pynvml` functions named here; nothing else
of the module is touched, so the code under test is the code that runs on a GPU machine.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from flowrl.placement.devices import Device, GpuProcess, Host, Inventory
from flowrl.placement.findings import Finding
from flowrl.placement.visible import device_order_problem, resolve_visible


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _bus(v) -> str:
    """Canonical PCI bus id: NVML writes `00000000:07:00.0` or `0000:07:00.0`."""
    parts = _text(v).lower().split(":")
    if len(parts) == 3:
        parts[0] = parts[0][-4:].rjust(4, "0")
    return ":".join(parts)


def _optional(fn, *args, default=None):
    """Call an NVML query the driver may not support (NVMLError -> default)."""
    import pynvml

    try:
        return fn(*args)
    except pynvml.NVMLError:
        return default


def _groups(n: int, linked) -> list[int]:
    """Component index of each of n items under the pairwise relation `linked(i, j)`."""
    parent = list(range(n))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in range(n):
        for j in range(i + 1, n):
            if linked(i, j):
                parent[find(j)] = find(i)
    roots = sorted({find(i) for i in range(n)})
    return [roots.index(find(i)) for i in range(n)]


def _nvlink_peers(handles, buses: list[str]) -> list[set[int]]:
    import pynvml

    peers: list[set[int]] = [set() for _ in handles]
    on_switch: set[int] = set()
    for i, h in enumerate(handles):
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                if pynvml.nvmlDeviceGetNvLinkState(h, link) != pynvml.NVML_FEATURE_ENABLED:
                    continue
                remote = _bus(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId)
            except pynvml.NVMLError:
                break  # no such link (or no NVLink at all) on this device
            if remote in buses and buses.index(remote) != i:
                peers[i].add(buses.index(remote))
            elif remote not in buses:
                on_switch.add(i)  # the far end is an NVSwitch
    for i in on_switch:
        peers[i] |= on_switch - {i}
    for i, ps in enumerate(peers):  # a link is a link both ways
        for j in ps:
            peers[j].add(i)
    return peers


def _processes(h, ignore: set[int]) -> tuple[GpuProcess, ...]:
    import pynvml

    out = []
    for p in _optional(pynvml.nvmlDeviceGetComputeRunningProcesses, h, default=[]) or []:
        if p.pid in ignore:
            continue
        name = ""
        try:
            import psutil

            name = psutil.Process(p.pid).name()
        except Exception:  # gone, other user's process, other PID namespace
            pass
        out.append(GpuProcess(pid=p.pid, used_bytes=getattr(p, "usedGpuMemory", None), name=name))
    return tuple(out)


@dataclass
class NvmlInventory(Inventory):
    """This machine's GPUs from NVML."""

    @classmethod
    def probe(cls, env: dict | None = None, ignore_pids: set[int] | None = None) -> "NvmlInventory | None":
        """The inventory, or None when NVML cannot start or sees no GPU (then plan on CPU)."""
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # no library, no driver, no permission: not a GPU machine for us
            return None
        try:
            return cls._read(os.environ if env is None else env, ignore_pids or {os.getpid()})
        except pynvml.NVMLError as e:  # a GPU is there but the driver will not say enough about it
            from flowrl.graph.errors import Problem
            from flowrl.placement.errors import InventoryError

            raise InventoryError([Problem("", f"NVML query failed: {e}", "check the driver with nvidia-smi, or "
                                          "plan on a declared inventory with --inventory FILE", "NVML")]) from None
        finally:
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError:
                pass

    @classmethod
    def _read(cls, env, ignore: set[int]) -> "NvmlInventory | None":
        import pynvml

        n = pynvml.nvmlDeviceGetCount()
        if n == 0:
            return None
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        buses = [_bus(pynvml.nvmlDeviceGetPciInfo(h).busId) for h in handles]
        level = {}
        for i in range(n):
            for j in range(i + 1, n):
                level[i, j] = _optional(pynvml.nvmlDeviceGetTopologyCommonAncestor, handles[i], handles[j])
        root = _groups(n, lambda i, j: level[i, j] is not None and level[i, j] <= pynvml.NVML_TOPOLOGY_HOSTBRIDGE)
        numa_by_level = _groups(n, lambda i, j: level[i, j] is not None and level[i, j] <= pynvml.NVML_TOPOLOGY_NODE)
        peers = _nvlink_peers(handles, buses)
        host = socket.gethostname() or "localhost"
        devices = {}
        for i, h in enumerate(handles):
            numa = _optional(pynvml.nvmlDeviceGetNumaNodeId, h) if hasattr(pynvml, "nvmlDeviceGetNumaNodeId") else None
            cc = _optional(pynvml.nvmlDeviceGetCudaComputeCapability, h)
            devices[i] = Device(
                host=host, id=i, type="cuda", name=_text(pynvml.nvmlDeviceGetName(h)),
                memory_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
                compute_capability=tuple(cc) if cc else None, uuid=_text(pynvml.nvmlDeviceGetUUID(h)),
                pcie_root=f"root{root[i]}" if any(v is not None for v in level.values()) else None,
                numa_node=numa if isinstance(numa, int) and numa >= 0 else numa_by_level[i],
                nvlink_peers=frozenset(peers[i]), processes=_processes(h, ignore),
            )
        raw = env.get("CUDA_VISIBLE_DEVICES")
        visible, problems = resolve_visible(raw, list(devices), {i: d.uuid or "" for i, d in devices.items()})
        notes = [Finding("cuda-visible-invalid", None, p + ". Fix: list only ids or UUIDs that "
                         "nvidia-smi shows, each once", host=host) for p in problems]
        order = device_order_problem(raw, {devices[p].name for p in visible}, env.get("CUDA_DEVICE_ORDER"))
        if order:
            notes.append(Finding("device-order", None, order, host=host))
        hosts = [Host(name=host, address="127.0.0.1", devices=devices, visible=visible, visible_env=raw)]
        return cls(hosts=hosts, device_type="cuda", source="NVML", notes=notes)
