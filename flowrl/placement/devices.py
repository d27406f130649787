"""What the planner knows about the machines: hosts, their devices, topology and current use.

Every inventory source (NVML, a declared YAML file, the CPU cores of this machine) produces the
same `Inventory`, so the planner and the checks never ask where the facts came from::

    inv = get_inventory("examples/inventories/a100x8-nvlink.yaml")
    host = inv.hosts[0]
    host.visible            # logical id -> physical id, as CUDA_VISIBLE_DEVICES says: [3, 1]
    inv.device(host.name, 3).nvlink_peers

Ids: a device's `id` is its *physical* id on its host (the NVML index, which is PCI bus order, or
the CPU core number). Graph files name *logical* ids, the ones a process sees under the
controller's `CUDA_VISIBLE_DEVICES`; `Host.visible` maps one to the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

GIB = 1 << 30
BUSY_MIN_BYTES = 256 << 20
"""A foreign process using less than this (an MPS daemon: ~30 MiB, a monitoring agent) does not make
a GPU busy. One whose use the driver does not report does."""
DeviceType = Literal["cuda", "cpu"]


@dataclass(frozen=True)
class GpuProcess:
    """A process already using a GPU (seen in NVML's compute process list)."""

    pid: int
    used_bytes: int | None = None  # None: the driver did not say (containers, permissions)
    name: str = ""

    def describe(self) -> str:
        used = "unknown memory" if self.used_bytes is None else f"{self.used_bytes / GIB:.1f} GiB"
        return f"pid {self.pid}{f' ({self.name})' if self.name else ''} using {used}"


@dataclass(frozen=True)
class Device:
    """One GPU or one CPU core of a host."""

    host: str
    id: int
    """Physical id on the host: NVML index (PCI bus order) or CPU core number."""
    type: DeviceType = "cuda"
    name: str = ""
    memory_bytes: int | None = None
    compute_capability: tuple[int, int] | None = None
    uuid: str | None = None
    pcie_root: str | None = None
    """PCIe root complex: devices under different roots talk through the CPU interconnect."""
    numa_node: int | None = None
    nvlink_peers: frozenset[int] = frozenset()
    """Physical ids of devices on the same host reachable over NVLink (directly or via NVSwitch)."""
    processes: tuple[GpuProcess, ...] = ()
    """Foreign processes currently using the device."""

    @property
    def busy(self) -> bool:
        """Used by a foreign job: a process of unknown use, or of at least BUSY_MIN_BYTES."""
        return any(p.used_bytes is None or p.used_bytes >= BUSY_MIN_BYTES for p in self.processes)

    @property
    def foreign_bytes(self) -> int:
        """Memory foreign processes hold (those of unknown use count as 0 here)."""
        return sum(p.used_bytes or 0 for p in self.processes)

    @property
    def memory_gib(self) -> float | None:
        return None if self.memory_bytes is None else self.memory_bytes / GIB

    def label(self) -> str:
        """`GPU 3 (A100-SXM4-80GB, 80 GiB)` / `core 1`: how messages name a device."""
        if self.type == "cpu":
            return f"core {self.id}"
        extra = [x for x in (self.name, f"{self.memory_gib:.0f} GiB" if self.memory_bytes else "") if x]
        return f"GPU {self.id}" + (f" ({', '.join(extra)})" if extra else "")


@dataclass
class Host:
    """One machine: its devices by physical id and what this process may see of them."""

    name: str
    address: str
    """Where other hosts reach it: MASTER_ADDR for groups whose rank 0 runs here."""
    devices: dict[int, Device]
    visible: list[int]
    """Logical id -> physical id (index = logical id), the order CUDA_VISIBLE_DEVICES gives."""
    visible_env: str | None = None
    """CUDA_VISIBLE_DEVICES as written (None: unset, everything visible). Shown in messages."""

    def physical(self, logical: int) -> int | None:
        return self.visible[logical] if 0 <= logical < len(self.visible) else None

    def logical(self, physical: int) -> int | None:
        return self.visible.index(physical) if physical in self.visible else None

    def visible_devices(self) -> list[Device]:
        return [self.devices[p] for p in self.visible]

    def mapping_text(self) -> str:
        """`CUDA_VISIBLE_DEVICES=3,1: logical 0 = physical 3, 1 = physical 1` for messages."""
        if not self.visible:
            return "no device is visible" + (f" (CUDA_VISIBLE_DEVICES={self.visible_env!r})" if self.visible_env is not None else "")
        pairs = ", ".join(f"{i}={p}" for i, p in enumerate(self.visible))
        head = f"CUDA_VISIBLE_DEVICES={self.visible_env}" if self.visible_env is not None else "CUDA_VISIBLE_DEVICES unset"
        if self.visible == sorted(self.visible) and self.visible == list(range(len(self.visible))):
            return f"{head}: logical = physical ids 0-{len(self.visible) - 1}"
        return f"{head}: logical->physical {pairs}"


@dataclass
class Inventory:
    """The devices the planner may use, from one source. Subclasses only differ in how they are
    built (`NvmlInventory.probe()`, `DeclaredInventory.load(path)`, `CpuInventory.probe()`)."""

    hosts: list[Host]
    device_type: DeviceType
    source: str = ""
    """Where the facts came from, for the check header: `NVML`, `file x.yaml`, `CPU cores`."""
    notes: list = field(default_factory=list)
    """Findings about the inventory itself (e.g. a CUDA_VISIBLE_DEVICES entry CUDA would reject)."""

    def host(self, name: str) -> Host | None:
        return next((h for h in self.hosts if h.name == name), None)

    def device(self, host: str, physical: int) -> Device:
        return self.host(host).devices[physical]  # type: ignore[union-attr]

    @property
    def multi_host(self) -> bool:
        return len(self.hosts) > 1

    def visible_count(self) -> int:
        return sum(len(h.visible) for h in self.hosts)

    def describe(self) -> str:
        """One line for the check header: `file a100.yaml: 1 host, 8 GPUs (8 x A100 80 GiB)`."""
        n = self.visible_count()
        unit = "GPU" if self.device_type == "cuda" else "CPU core"
        models: dict[str, int] = {}
        for h in self.hosts:
            for d in h.visible_devices():
                if d.type == "cuda":
                    key = f"{d.name or 'GPU'} {d.memory_gib:.0f} GiB" if d.memory_bytes else (d.name or "GPU")
                    models[key] = models.get(key, 0) + 1
        kinds = ", ".join(f"{c} x {m}" for m, c in models.items())
        hosts = f"{len(self.hosts)} host{'s' if len(self.hosts) != 1 else ''}"
        return f"{self.source}: {hosts}, {n} {unit}{'s' if n != 1 else ''}" + (f" ({kinds})" if kinds else "")
