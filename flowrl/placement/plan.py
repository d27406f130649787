"""The placement plan: one entry per node process, and the environment that process starts with.

    plan = make_plan(spec, inventory)
    for entry in plan.entries:
        env = plan.env_for(entry, master_port=ports[entry.node, entry.replica])
        launch(entry.node, entry.replica, entry.rank, env)

Layout is torchrun's: a replica with D devices is D processes forming their own torch.distributed
group (WORLD_SIZE = D), ranks host by host (RANK = node_rank * nproc_per_node + LOCAL_RANK), and
every process of a replica on one host sees that host's devices of the replica (in rank order)
through CUDA_VISIBLE_DEVICES, driving `cuda:LOCAL_RANK`. `devices` holds the physical id the
process drives; `local_devices` the id it has inside its CUDA_VISIBLE_DEVICES. On CPU the device is
a core: the process pins itself to `FLOWRL_CPU_CORES` (no renumbering, so local = physical).

`master_port` is None when the launcher is to pick a free port on `master_addr` (one per group,
see `Plan.groups`); it then passes that port to `env_for`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from flowrl.placement.findings import Finding, sort_findings


@dataclass(frozen=True)
class PlanEntry:
    """One process: rank `rank` of replica `replica` of node `node`."""

    node: str
    replica: int
    rank: int
    local_rank: int
    """Index of this process among the replica's processes on its host."""
    world_size: int
    """Processes of this replica (its own torch.distributed group)."""
    host: str
    devices: list[int]
    """Physical ids this process drives: one GPU, one core, or none (CPU process left unpinned)."""
    local_devices: list[int]
    """The same devices as the process sees them after CUDA_VISIBLE_DEVICES (cores: unchanged)."""
    device_type: str
    """`cuda` or `cpu`."""
    master_addr: str
    master_port: int | None
    """None: chosen by the launcher (a free port on master_addr), then given to `Plan.env_for`."""
    mesh: list[int]
    """Shape of the replica's device mesh, e.g. [2, 2] (data x tensor); [D] when flat."""
    mesh_coord: list[int]
    """This rank's position in `mesh` (row-major: the last dimension varies fastest)."""
    visible_devices: list[int] = field(default_factory=list)
    """Physical ids in this process's CUDA_VISIBLE_DEVICES: the replica's devices on this host."""

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Plan:
    """Every process of the graph and every finding about where they run."""

    entries: list[PlanEntry]
    findings: list[Finding]
    device_type: str = "cpu"
    inventory: str = ""
    """One line saying which inventory was planned on (for the check header)."""
    memory: list[dict] = field(default_factory=list)
    """What the memory model puts on each GPU, one row per set of GPUs holding the same load
    (flowrl/placement/turns.py `memory_lines`): host, devices, text, bytes, summed_bytes,
    capacity_bytes, turns. Empty on CPU."""

    def __post_init__(self):
        self.findings = sort_findings(self.findings)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def for_node(self, node: str) -> list[PlanEntry]:
        return [e for e in self.entries if e.node == node]

    def groups(self) -> dict[tuple[str, int], list[PlanEntry]]:
        """(node, replica) -> its processes in rank order: one torch.distributed group each."""
        out: dict[tuple[str, int], list[PlanEntry]] = {}
        for e in self.entries:
            out.setdefault((e.node, e.replica), []).append(e)
        return {k: sorted(v, key=lambda e: e.rank) for k, v in out.items()}

    def to_json(self) -> dict:
        """`flowrl check --json` and RUN_DIR/plan.json (DESIGN.md section 10)."""
        return {"plan": [e.to_json() for e in self.entries], "findings": [f.to_json() for f in self.findings],
                "memory": self.memory}

    def env_for(self, entry: PlanEntry, master_port: int | None = None) -> dict[str, str]:
        """Environment variables for `entry`'s process, to set before anything touches CUDA."""
        port = master_port if master_port is not None else entry.master_port
        if port is None:
            raise ValueError(f"{entry.node} replica {entry.replica}: the plan leaves MASTER_PORT to the launcher; "
                             "pass master_port= (one free port on master_addr per group, see Plan.groups())")
        env = {
            "RANK": str(entry.rank), "LOCAL_RANK": str(entry.local_rank), "WORLD_SIZE": str(entry.world_size),
            "LOCAL_WORLD_SIZE": str(sum(1 for e in self.groups()[entry.node, entry.replica] if e.host == entry.host)),
            "MASTER_ADDR": entry.master_addr, "MASTER_PORT": str(port),
        }
        if entry.device_type == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, entry.visible_devices))
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # integer ids above are NVML (PCI bus) order
        else:
            env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU process must not initialise CUDA
            if entry.devices:
                env["FLOWRL_CPU_CORES"] = ",".join(map(str, entry.devices))
                env["OMP_NUM_THREADS"] = str(len(entry.devices))
        return env

    @classmethod
    def from_json(cls, data: dict) -> "Plan":
        """Read back `to_json()` (e.g. RUN_DIR/plan.json on --resume)."""
        entries = [PlanEntry(**e) for e in data["plan"]]
        findings = [Finding(code=f["code"], node=f["node"], message=f["message"], devices=tuple(f["devices"]),
                            host=f.get("host"), severity=f["severity"]) for f in data["findings"]]
        kinds = {e.device_type for e in entries}
        return cls(entries, findings, device_type="cuda" if "cuda" in kinds else "cpu", memory=data.get("memory", []))
