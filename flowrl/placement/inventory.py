"""Which inventory to plan on: `--inventory FILE` (or `ray[:ADDRESS]`), else NVML when a GPU is present, else CPU cores.

    inv = get_inventory()                                   # this machine
    inv = get_inventory("examples/inventories/cluster-2x8.yaml")

The three sources share the `Inventory` interface (flowrl/placement/devices.py); this factory is
the only place that chooses between them.
"""

from __future__ import annotations

from pathlib import Path

from flowrl.placement.cpu import CpuInventory
from flowrl.placement.declared import DeclaredInventory
from flowrl.placement.devices import Inventory
from flowrl.placement.nvml import NvmlInventory


def get_inventory(path: str | Path | None = None, *, env: dict | None = None) -> Inventory:
    """The declared inventory at `path`; else this machine's GPUs (NVML); else its CPU cores.

    A machine whose GPUs are all hidden (`CUDA_VISIBLE_DEVICES=""` or `-1`) plans on its CPU
    cores, as torch would run there. Raises InventoryError (a GraphError) for a bad file.
    """
    if path is not None and (str(path) == "ray" or str(path).startswith("ray:")):
        from flowrl.placement.ray_inventory import RayInventory  # `ray[:ADDRESS]`: a Ray cluster's nodes

        return RayInventory.probe(str(path)[4:] or None)
    if path is not None:
        return DeclaredInventory.load(path)
    gpus = NvmlInventory.probe(env=env)
    if gpus is not None and gpus.visible_count() > 0:
        return gpus
    cpu = CpuInventory.probe()
    if gpus is not None:
        cpu.notes.extend(gpus.notes)  # say why the GPUs were not used
        cpu.source = "CPU cores (every GPU hidden by CUDA_VISIBLE_DEVICES)"
    return cpu
