"""Findings: what is wrong (or worth knowing) about a placement, each with a stable code.

Codes are part of the command-line contract (`flowrl check --json`, docs/placement.md): scripts
and tests match on them, so a code, once shipped, keeps its meaning. Messages carry the value, the
limit and the fix::

    error  device-busy  actor  [0]  GPU 0 (A100 80 GiB) is in use by another job: pid 4242 (python)
           using 31.0 GiB. Fix: pick idle GPUs (idle: 4, 5, 6, 7) or stop that job first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Severity = Literal["error", "warning", "info"]
SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}
MESSAGE_CHARS = 1500

# code -> (severity, family, one line for docs/placement.md). The family is the seed mistake the
# check guards against; every family has a test and a wrong example in examples/wrong/.
CODES: dict[str, tuple[Severity, str, str]] = {
    "device-not-visible": ("error", "visibility", "an explicit device id is out of range or hidden by CUDA_VISIBLE_DEVICES"),
    "unknown-host": ("error", "visibility", "a node or device names a host the inventory does not have"),
    "cuda-visible-invalid": ("warning", "visibility", "CUDA_VISIBLE_DEVICES holds an entry CUDA stops at; later entries are ignored"),
    "device-order": ("warning", "visibility", "integer CUDA_VISIBLE_DEVICES on mixed GPU models without CUDA_DEVICE_ORDER=PCI_BUS_ID"),
    "overlap-forbidden": ("error", "overlap", "actor/critic, or reference/reward with actor/critic, share a device without colocate_with"),
    "overlap": ("warning", "overlap", "two nodes share a GPU without declaring colocate_with"),
    "cpu-shared": ("info", "overlap", "several node processes time-share a CPU core (normal on a CPU-only machine)"),
    "not-enough-devices": ("error", "capacity", "a node asks for more (free) devices than the inventory has"),
    "replica-split": ("error", "mesh", "an explicit device list does not split evenly over the replicas"),
    "mesh-mismatch": ("error", "mesh", "the mesh shape's product differs from the devices per replica"),
    "mixed-memory": ("warning", "memory", "one group holds GPUs of different memory sizes"),
    "device-busy": ("warning", "busy", "a planned GPU is used by a foreign job (error when the memory left is less than the plan "
                    "needs, or a trainer's need leaves under 10% of the card)"),
    "nvlink-missed": ("warning", "topology", "a group has fewer NVLink links than an available group of that size"),
    "pcie-split": ("warning", "topology", "a group without NVLink spans PCIe root complexes although one root could hold it"),
    "dtype-mismatch": ("warning", "dtype", "an edge carries compute-dtype tensors into a node computing in another dtype "
                       "(error between float16 and bfloat16 nodes, on any edge)"),
    "bf16-unsupported": ("error", "dtype", "bfloat16 on a GPU below compute capability 8.0"),
    "rank-layout": ("error", "hosts", "a multi-host group has an uneven or interleaved torchrun rank layout"),
    "group-network": ("info", "hosts", "a group spans hosts: where its store listens and which network interface each host's "
                      "ranks use (or that it cannot be told from here)"),
    "tp-across-hosts": ("warning", "hosts", "the tensor-parallel (last) dimension of a multi-dimensional mesh crosses hosts"),
    "no-weight-subscriber": ("warning", "weights", "a node that publishes weights (a trainer) in a graph where no node takes weights"),
    "unfed-subscriber": ("error", "weights", "a node that takes weights has no `weights:` edge into it while a trainer publishes"),
    "stateful-replicas": ("error", "replicas", "replicas > 1 of a stateful node that does not declare how its replicas merge"),
    "concurrency-unsupported": ("error", "replicas", "concurrency > 1 on a stateful node or on a node with several ranks per replica"),
    "memory-exceeded": ("error", "memory", "the memory model puts more on a GPU than it has (weights, gradients, Adam, activations)"),
    "memory-headroom": ("warning", "memory", "the memory model puts more than 90% of a GPU's memory on it"),
    "model-size-unknown": ("warning", "memory", "a node's model size cannot be learned here (folder elsewhere, no `model_size`)"),
    "extra-missing": ("info", "extras", "the graph uses an optional extra (vLLM, transformers, peft, ray, ...) not installed here"),
    "fused": ("info", "overlap", "nodes run inside another node's process (`fuse_into`); a model a fused node holds counts "
              "on its host's GPUs"),
    "token-budget": ("warning", "tokens", "a node packs micro-batches of fewer tokens than the longest sequence the graph allows"),
}


@dataclass(frozen=True)
class Finding:
    """One problem or note about the plan."""

    code: str
    node: str | None
    message: str
    """What is wrong with the numbers, then `Fix: ...`."""
    devices: tuple[int, ...] = ()
    """Physical ids concerned (on `host`)."""
    host: str | None = None
    severity: Severity = field(default=None)  # type: ignore[assignment]

    def __post_init__(self):
        assert self.code in CODES, f"unregistered finding code {self.code!r}"
        if len(self.message) > MESSAGE_CHARS:  # names from a file can be long; keep the head and the fix
            cut = len(self.message) - MESSAGE_CHARS + 60
            keep = MESSAGE_CHARS - 500
            object.__setattr__(self, "message", f"{self.message[:keep]} ...[{cut:,} characters cut]... "
                                                f"{self.message[-440:]}")
        if self.severity is None:
            object.__setattr__(self, "severity", CODES[self.code][0])

    def to_json(self) -> dict:
        return {"severity": self.severity, "code": self.code, "node": self.node,
                "devices": list(self.devices), "host": self.host, "message": self.message}


def dedupe(findings: list[Finding]) -> list[Finding]:
    """One finding per (code, node, host): repeats (per replica, per device) fold into the first,
    which then names every device concerned and how many times it was found."""
    out: dict[tuple, Finding] = {}
    count: dict[tuple, int] = {}
    for f in findings:
        key = (f.code, f.node, f.host, f.severity) if f.node else (id(f),)
        if key not in out:
            out[key], count[key] = f, 1
            continue
        first = out[key]
        count[key] += 1
        devices = tuple(sorted(set(first.devices) | set(f.devices)))
        out[key] = Finding(first.code, first.node, first.message, devices, first.host, first.severity)
    result = []
    for key, f in out.items():
        if count[key] > 1:
            f = Finding(f.code, f.node, f"{f.message} (found {count[key]} times for this node; devices "
                        f"{ids_text(f.devices)} in all)", f.devices, f.host, f.severity)
        result.append(f)
    return result


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Errors first, then warnings, then notes; stable within a severity (discovery order)."""
    return sorted(findings, key=lambda f: SEVERITY_ORDER[f.severity])


def ids_text(ids) -> str:
    """`[0, 1, 2, 3]` -> `0-3`; `[0, 2, 5]` -> `0, 2, 5` (how messages list device ids)."""
    ids = sorted(ids)
    if len(ids) > 2 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return ", ".join(map(str, ids)) if ids else "none"
