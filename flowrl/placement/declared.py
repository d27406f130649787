"""A declared inventory: a YAML file describing machines you are not on (a cluster, CI, tests).

    flowrl check graphs/ppo.yaml --inventory examples/inventories/a100x8-nvlink.yaml

The format (every key documented in docs/placement.md; unknown keys are errors with file + line)::

    hosts:
      - name: node0
        address: 10.0.0.1            # MASTER_ADDR when a group's rank 0 runs here (default: name)
        cuda_visible_devices: "3,1"  # optional: as the controller's CUDA_VISIBLE_DEVICES there
        gpu_defaults: {name: A100-SXM4-80GB, memory_gb: 80, compute_capability: "8.0"}
        gpus:
          - {id: 0, nvlink: [1], pcie_root: 0, numa_node: 0}
          - {id: 1, processes: [{pid: 4242, memory_gb: 31.5, name: python}]}
      - name: laptop
        cpus: 2                      # a host without GPUs: cores 0..cpus-1 are its devices
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import ConfigDict, Field, ValidationError, field_validator

from flowrl.graph.errors import Problem
from flowrl.graph.reading import Located, decode, parse_yaml
from flowrl.graph.spec import StrictModel as _Strict
from flowrl.placement.cpu import cpu_host
from flowrl.placement.devices import GIB, Device, GpuProcess, Host, Inventory
from flowrl.placement.errors import InventoryError, problems_from
from flowrl.placement.findings import Finding
from flowrl.placement.visible import device_order_problem, resolve_visible


MAX_GPUS_PER_HOST = 512
MAX_HOSTS = 256
MAX_CPUS = 4096
MAX_MEMORY_GB = 1 << 20


class StrictModel(_Strict):
    """Unknown keys are errors; so are `.inf` and `.nan`, which no inventory value can be."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def _capability(v):
    if v is None or isinstance(v, tuple):
        return v
    parts = str(v).split(".")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"compute capability {v!r} must read 'major.minor', e.g. \"8.0\"")
    return int(parts[0]), int(parts[1])


class ProcessDecl(StrictModel):
    """A foreign process using a GPU (what `nvidia-smi --query-compute-apps` lists)."""

    pid: int = Field(ge=0)
    memory_gb: float | None = Field(None, ge=0, le=MAX_MEMORY_GB)
    """GiB it uses; unknown if left out."""
    name: str = ""


class GpuDefaultsDecl(StrictModel):
    """Values every GPU of the host has unless it says otherwise."""

    name: str = ""
    memory_gb: float | None = Field(None, gt=0, le=MAX_MEMORY_GB)
    """Total memory in GiB, as nvidia-smi reports it (80 for an A100 80GB)."""
    compute_capability: str | float | None = None
    pcie_root: str | int | None = None
    numa_node: int | None = Field(None, ge=0)


class GpuDecl(GpuDefaultsDecl):
    """One GPU. `id` is its physical id: the nvidia-smi index (PCI bus order)."""

    id: int = Field(ge=0, lt=1 << 16)
    uuid: str | None = None
    nvlink: list[int] = Field(default_factory=list)
    """Physical ids of GPUs on this host it has NVLink to (links count both ways)."""
    processes: list[ProcessDecl] = Field(default_factory=list)


class HostDecl(StrictModel):
    """One machine."""

    name: str = Field(min_length=1, max_length=253)
    """Host name (at most 253 characters, as in DNS)."""
    address: str | None = Field(None, max_length=253)
    cuda_visible_devices: str | int | None = None
    cuda_device_order: str | None = None
    """CUDA_DEVICE_ORDER in the controller's environment there (`PCI_BUS_ID`, `FASTEST_FIRST`, unset)."""
    cpus: int | None = Field(None, ge=1, le=MAX_CPUS)
    nvswitch: bool = False
    """All GPUs of the host reach each other over NVLink (NVSwitch systems: DGX/HGX)."""
    gpu_defaults: GpuDefaultsDecl = Field(default_factory=GpuDefaultsDecl)
    gpus: list[GpuDecl] = Field(default_factory=list, max_length=MAX_GPUS_PER_HOST)


class InventoryDecl(StrictModel):
    """A whole inventory file."""

    name: str = ""
    hosts: list[HostDecl] = Field(min_length=1, max_length=MAX_HOSTS)

    @field_validator("hosts")
    @classmethod
    def _names_unique(cls, v):
        names = [h.name for h in v]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"host name(s) {dup} appear twice; every host needs its own name")
        return v


def _problem(located: Located, loc: tuple, message: str, fix: str) -> Problem:
    return Problem(".".join(map(str, loc)), message, fix, located.file, located.line_of(loc))


def _gpu_host(h: HostDecl, i: int, located: Located, problems: list[Problem], notes: list[Finding]) -> Host:
    base = ("hosts", i)
    ids = [g.id for g in h.gpus]
    for j, g in enumerate(h.gpus):
        if ids.count(g.id) > 1 and ids.index(g.id) != j:
            problems.append(_problem(located, base + ("gpus", j, "id"), f"GPU id {g.id} appears twice on host {h.name!r}",
                                     "give every GPU its own id (the nvidia-smi index)"))
        for k, peer in enumerate(g.nvlink):
            if peer not in ids or peer == g.id:
                problems.append(_problem(located, base + ("gpus", j, "nvlink", k),
                                         f"GPU {g.id} lists NVLink peer {peer}, which is {'itself' if peer == g.id else 'not a GPU of this host'}",
                                         f"name peers among GPU ids {ids}"))
    peers: dict[int, set[int]] = {g.id: set(ids) - {g.id} if h.nvswitch else set(g.nvlink) for g in h.gpus}
    for g, ps in list(peers.items()):
        for p in ps:
            peers.setdefault(p, set()).add(g)
    d = h.gpu_defaults
    devices = {}
    for j, g in enumerate(h.gpus):
        mem = g.memory_gb if g.memory_gb is not None else d.memory_gb
        root = g.pcie_root if g.pcie_root is not None else d.pcie_root
        try:
            cc = _capability(g.compute_capability if g.compute_capability is not None else d.compute_capability)
        except ValueError as e:
            problems.append(_problem(located, base + ("gpus", j, "compute_capability"), str(e), "write it as a string, e.g. \"8.0\""))
            cc = None
        devices[g.id] = Device(
            host=h.name, id=g.id, type="cuda", name=g.name or d.name, uuid=g.uuid,
            memory_bytes=None if mem is None else int(mem * GIB), compute_capability=cc,
            pcie_root=None if root is None else str(root),
            numa_node=g.numa_node if g.numa_node is not None else d.numa_node,
            nvlink_peers=frozenset(peers.get(g.id, ())),
            processes=tuple(GpuProcess(p.pid, None if p.memory_gb is None else int(p.memory_gb * GIB), p.name)
                            for p in g.processes))
    raw = None if h.cuda_visible_devices is None else str(h.cuda_visible_devices)
    visible, issues = resolve_visible(raw, sorted(devices), {k: v.uuid or "" for k, v in devices.items()})
    notes += [Finding("cuda-visible-invalid", None, f"host {h.name}: {m}. Fix: list only GPU ids or UUIDs of "
                      "this host, each once", host=h.name) for m in issues]
    order = device_order_problem(raw, {devices[p].name for p in visible if p in devices}, h.cuda_device_order)
    if order:
        notes.append(Finding("device-order", None, f"host {h.name}: {order}", host=h.name))
    return Host(name=h.name, address=h.address or h.name, devices=devices, visible=visible, visible_env=raw)


@dataclass
class DeclaredInventory(Inventory):
    """Hosts and devices read from an inventory file."""

    @classmethod
    def load(cls, path: str | Path) -> "DeclaredInventory":
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise InventoryError([Problem("", f"cannot read inventory file: {e.strerror or e}",
                                          "check the path; examples are in examples/inventories/", str(path))]) from None
        return cls.from_text(decode(data, str(path)), str(path))

    @classmethod
    def from_text(cls, text: str, file: str | None = None) -> "DeclaredInventory":
        located = parse_yaml(text, file)  # raises GraphError on YAML syntax
        if not isinstance(located.data, dict):
            raise InventoryError([Problem("", "an inventory file is a mapping with `hosts:`",
                                          "start from examples/inventories/a100x8-nvlink.yaml", file, 1)])
        try:
            decl = InventoryDecl.model_validate(located.data)
        except ValidationError as e:
            raise InventoryError(problems_from(e, located, InventoryDecl)) from None
        problems: list[Problem] = []
        notes: list[Finding] = []
        has_gpus = any(h.gpus for h in decl.hosts)
        hosts = []
        for i, h in enumerate(decl.hosts):
            if has_gpus and not h.gpus:
                problems.append(_problem(located, ("hosts", i), f"host {h.name!r} has no `gpus:` while other hosts do",
                                         "plan GPU hosts and CPU-only hosts in separate inventories"))
            elif not has_gpus and h.cpus is None:
                problems.append(_problem(located, ("hosts", i), f"host {h.name!r} has neither `gpus:` nor `cpus:`",
                                         "list its GPUs, or give `cpus: N` for a CPU-only host"))
            elif has_gpus:
                hosts.append(_gpu_host(h, i, located, problems, notes))
            else:
                hosts.append(cpu_host(h.name, h.address or h.name, list(range(h.cpus or 1))))
        if problems:
            raise InventoryError(problems)
        return cls(hosts=hosts, device_type="cuda" if has_gpus else "cpu",
                   source=f"file {file or '<text>'}", notes=notes)
