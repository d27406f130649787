"""What the controller tells a node process about itself, written as JSON before it starts.

One file per process start (`RUN_DIR/procs/<node>.<replica>.<rank>.json`, 0600 in the 0700 run
directory): the local launchers hand the worker its path. The ray launcher hands the text itself
through the actor call, which the worker reads from its stdin (`FLOWRL_SPEC_STDIN=1`), so the keys
in it are never written on another host.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

# What a launcher runs for a spec: `python -m WORKER_MODULE SPEC_PATH`, or its `main([SPEC_PATH])`
# in a forked child. A name, not an import: launchers do not know the worker's code.
WORKER_MODULE = "flowrl.runtime.worker"


@dataclass
class OutputRoute:
    """One graph edge leaving this process: where its consumer replicas listen."""

    edge: str  # "rollout.out -> reward.in"
    port: str  # our output port
    addresses: list[str]  # one per consumer replica
    capacity: int = 4
    capacity_bytes: int = 1 << 30
    keys: dict[str, str] = field(default_factory=dict)  # tcp address -> that consumer's CURVE public key


@dataclass
class ProcSpec:
    node: str
    kind: str
    replica: int
    replicas: int
    rank: int
    world_size: int
    incarnation: int
    run_dir: str
    graph_file: str
    control: str  # controller's control-plane address
    inputs: dict[str, str] = field(default_factory=dict)  # input port -> address this process binds
    outputs: list[OutputRoute] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # devices, ranks (applied before torch/CUDA use)
    device_type: str = "cpu"
    cpu_cores: list[int] = field(default_factory=list)
    devices: list[int] = field(default_factory=list)  # physical ids
    resume_from: str | None = None  # stateful: checkpoint file to load after setup
    is_sink: bool = False
    is_source: bool = False
    epoch: int = 0  # recovery epoch to start in
    watermark: int = 0  # stateful: next ticket index (the checkpoint's step); sinks: every ticket below is consumed
    consumed: list[int] = field(default_factory=list)  # stateless sinks: tickets >= watermark already consumed
    faults: list[str] = field(default_factory=list)
    heartbeat_s: float = 0.5
    peer_timeout_s: float = 300.0  # data channels wait this long for a silent peer (supervision.peer_timeout_s)
    host: str | None = None  # the plan's host for this process (the ray launcher pins it there)
    rank_addresses: list[str] = field(default_factory=list)  # data-parallel nodes: where each rank listens
    rank_keys: list[str] = field(default_factory=list)  # each rank's CURVE public key where its address is tcp, else ''
    rank_clients: list[str] | None = None  # this rank's tcp shard channel: the peer keys it admits (None: no CURVE)
    serving_dtype: str | None = None  # publishers: the dtype their subscribers hold weights in
    secret: str = ""  # the run's control-plane secret (the file is readable by its owner only)
    sys_path: list[str] = field(default_factory=list)  # the controller's import path, for user node modules
    steps: int = 0  # tickets the run issues now (0: the graph's schedule.steps); grows with replaced tickets
    host_address: str = "127.0.0.1"  # this host's cluster address: tcp inputs and the weight store bind here
    curve_public: str = ""  # this process's CURVE key pair (per run), for tcp inputs, outputs and control
    curve_secret: str = ""
    control_key: str | None = None  # the controller's CURVE public key when `control` is tcp
    input_clients: dict[str, list[str]] = field(default_factory=dict)  # tcp input port -> producer keys it admits
    services: list[str] = field(default_factory=list)  # servers this node sends requests to (`services:` of the graph)
    colocation: str | None = None  # its colocation group (`colocate_with`, transitive): weights go by handoff
    turn_group: str | None = None  # colocated nodes that take turns on their devices (`take_turns`): the group's name
    turn_timeout_s: float = 1200.0  # the longest a member waits for its turn (a holder's call is bounded by process_timeout_s)
    own_dir: str | None = None  # its host's run folder (`launcher.host_dirs`): logs, pid file, checkpoints; None: run_dir
    graph_text: str = ""  # the graph's YAML, written to graph_file when that host lacks it (no shared run directory)
    checkpoint_copy: str | None = None  # `launcher.checkpoint_uri`'s folder for this run: shards are copied there too

    @property
    def proc_id(self) -> str:
        return f"{self.node}/{self.replica}/{self.rank}"

    @property
    def home(self) -> str:
        """The folder this process keeps its files in on its host (`own_dir`, else the run directory)."""
        return self.own_dir or self.run_dir

    @property
    def log_name(self) -> str:
        return f"{self.node}.{self.replica}.{self.rank}"

    def write(self, path: Path) -> Path:
        path.write_text(json.dumps(asdict(self), indent=1))
        return path

    @classmethod
    def read(cls, path: str | Path) -> "ProcSpec":
        return cls.from_json(Path(path).read_text())

    @classmethod
    def from_json(cls, text: str) -> "ProcSpec":
        data = json.loads(text)
        data["outputs"] = [OutputRoute(**o) for o in data["outputs"]]
        return cls(**data)
