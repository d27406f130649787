"""The NVML inventory, with a stand-in only at the pynvml function boundary (no GPU needed).

The fake machine: 4 GPUs; NVLink bridges 0-1 and 2-3; 0-1 under one PCIe root, 2-3 under
another (NUMA node 1); GPU 2 runs a foreign process. A second fake puts every GPU on an NVSwitch.
"""

import os
from types import SimpleNamespace

import pynvml
import pytest

from flowrl.placement import get_inventory, make_plan
from flowrl.placement.nvml import NvmlInventory

from tests.placement.conftest import graph

BUS = ["00000000:07:00.0", "00000000:0B:00.0", "00000000:48:00.0", "00000000:4C:00.0"]
SWITCH = "00000000:FF:00.0"


def _not_supported(*_):
    raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)


def install(monkeypatch, links, procs=None, names=None, count=4, init_fails=False):
    """Replace the pynvml functions NvmlInventory calls. `links[i]` = remote bus ids of GPU i."""
    procs = procs or {}
    names = names or ["NVIDIA A100-SXM4-80GB"] * count

    def init():
        if init_fails:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    def level(a, b):
        return pynvml.NVML_TOPOLOGY_SINGLE if a // 2 == b // 2 else pynvml.NVML_TOPOLOGY_SYSTEM

    def link_state(h, link):
        if link >= len(links[h]):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return pynvml.NVML_FEATURE_ENABLED

    fakes = {
        "nvmlInit": init, "nvmlShutdown": lambda: None, "nvmlDeviceGetCount": lambda: count,
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetName": lambda h: names[h],
        "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(total=80 * 2**30, used=0, free=80 * 2**30),
        "nvmlDeviceGetCudaComputeCapability": lambda h: (8, 0),
        "nvmlDeviceGetUUID": lambda h: f"GPU-{h}{h}{h}{h}0000-aaaa",
        "nvmlDeviceGetPciInfo": lambda h: SimpleNamespace(busId=BUS[h].encode()),
        "nvmlDeviceGetNumaNodeId": _not_supported,
        "nvmlDeviceGetComputeRunningProcesses": lambda h: [SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in procs.get(h, [])],
        "nvmlDeviceGetTopologyCommonAncestor": level,
        "nvmlDeviceGetNvLinkState": link_state,
        "nvmlDeviceGetNvLinkRemotePciInfo": lambda h, link: SimpleNamespace(busId=links[h][link]),
    }
    for name, fn in fakes.items():
        monkeypatch.setattr(pynvml, name, fn)


BRIDGES = [[BUS[1]], [BUS[0]], [BUS[3]], [BUS[2]]]


def test_nvml_inventory_reads_names_memory_topology_and_processes(monkeypatch):
    install(monkeypatch, BRIDGES, procs={2: [(4242, 31 * 2**30)]})
    inv = NvmlInventory.probe(env={})
    devs = inv.hosts[0].devices
    assert inv.device_type == "cuda" and inv.hosts[0].visible == [0, 1, 2, 3]
    assert devs[0].nvlink_peers == {1} and devs[3].nvlink_peers == {2}
    assert devs[0].pcie_root == devs[1].pcie_root != devs[2].pcie_root
    assert devs[0].numa_node != devs[2].numa_node  # from the topology level (NUMA id not supported)
    assert devs[0].compute_capability == (8, 0) and devs[0].memory_gib == 80
    assert devs[2].processes[0].pid == 4242 and devs[2].processes[0].used_bytes == 31 * 2**30
    assert devs[1].uuid == "GPU-11110000-aaaa"


def test_nvswitch_links_connect_every_gpu_on_the_fabric(monkeypatch):
    install(monkeypatch, [[SWITCH, SWITCH]] * 4)
    devs = NvmlInventory.probe(env={}).hosts[0].devices
    assert all(devs[i].nvlink_peers == {0, 1, 2, 3} - {i} for i in range(4))


def test_own_process_is_not_a_foreign_one(monkeypatch):
    install(monkeypatch, BRIDGES, procs={0: [(os.getpid(), 1 << 30)]})
    assert not NvmlInventory.probe(env={}).hosts[0].devices[0].busy


def test_cuda_visible_devices_3_1_plans_logical_0_on_physical_3(monkeypatch):
    install(monkeypatch, BRIDGES)
    inv = NvmlInventory.probe(env={"CUDA_VISIBLE_DEVICES": "3,1"})
    plan = make_plan(graph("  actor: {kind: R:Actor, devices: [0]}"), inv)
    (entry,) = plan.entries
    assert entry.devices == [3] and entry.local_devices == [0]
    assert plan.env_for(entry, master_port=29500)["CUDA_VISIBLE_DEVICES"] == "3"


def test_uuid_in_cuda_visible_devices_selects_that_gpu(monkeypatch):
    install(monkeypatch, BRIDGES)
    inv = NvmlInventory.probe(env={"CUDA_VISIBLE_DEVICES": "GPU-2222"})
    assert inv.hosts[0].visible == [2]


def test_integer_ids_on_mixed_models_without_pci_bus_order_warn(monkeypatch):
    install(monkeypatch, BRIDGES, names=["A100"] * 2 + ["L40S"] * 2)
    inv = NvmlInventory.probe(env={"CUDA_VISIBLE_DEVICES": "0,2"})
    assert [n.code for n in inv.notes] == ["device-order"]
    inv = NvmlInventory.probe(env={"CUDA_VISIBLE_DEVICES": "0,2", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert inv.notes == []


def test_factory_uses_nvml_when_a_gpu_is_present(monkeypatch):
    install(monkeypatch, BRIDGES)
    assert get_inventory(env={}).source == "NVML"


@pytest.mark.parametrize("case", ["init fails", "no gpu", "all hidden"])
def test_factory_falls_back_to_cpu_cores(monkeypatch, case):
    install(monkeypatch, BRIDGES, init_fails=case == "init fails", count=0 if case == "no gpu" else 4)
    inv = get_inventory(env={"CUDA_VISIBLE_DEVICES": ""} if case == "all hidden" else {})
    assert inv.device_type == "cpu" and inv.hosts[0].visible == sorted(os.sched_getaffinity(0))


def test_failing_nvml_query_is_a_clean_inventory_error(monkeypatch):
    from flowrl.placement import InventoryError

    install(monkeypatch, BRIDGES)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", _not_supported)
    with pytest.raises(InventoryError, match="NVML query failed"):
        NvmlInventory.probe(env={})
