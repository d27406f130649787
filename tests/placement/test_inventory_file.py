"""Declared inventory files: typed, unknown keys rejected, every error with file and line."""

import pytest

from flowrl.graph import GraphError
from flowrl.placement import InventoryError
from flowrl.placement.declared import DeclaredInventory

from tests.placement.conftest import INVENTORIES


def problems(text):
    with pytest.raises(InventoryError) as e:
        DeclaredInventory.from_text(text, "inv.yaml")
    return e.value.problems


@pytest.mark.parametrize("path", sorted(INVENTORIES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_inventory_loads(path):
    inv = DeclaredInventory.load(path)
    assert inv.visible_count() > 0 and not inv.notes


def test_shipped_inventories_describe_what_the_issue_asks_for():
    a100 = DeclaredInventory.load(INVENTORIES / "a100x8-nvlink.yaml")
    assert len(a100.hosts[0].visible) == 8 and {d.memory_gib for d in a100.hosts[0].devices.values()} == {80}
    mixed = DeclaredInventory.load(INVENTORIES / "mixed-40-80.yaml")
    assert sorted(d.memory_gib for d in mixed.hosts[0].devices.values()) == [40] * 4 + [80] * 4
    cluster = DeclaredInventory.load(INVENTORIES / "cluster-2x8.yaml")
    assert [len(h.visible) for h in cluster.hosts] == [8, 8]
    busy = DeclaredInventory.load(INVENTORIES / "busy4.yaml")
    assert sum(d.busy for d in busy.hosts[0].devices.values()) == 4


def test_unknown_key_names_file_line_and_a_suggestion():
    (p,) = problems("hosts:\n  - name: h\n    gpus:\n      - id: 0\n        memroy_gb: 80\n")
    assert (p.file, p.line, p.path) == ("inv.yaml", 5, "hosts.0.gpus.0.memroy_gb")
    assert "memory_gb" in p.fix


def test_bad_values_are_reported_together():
    found = problems("hosts:\n  - name: h\n    gpus:\n      - {id: -1}\n      - {id: 1, memory_gb: 0}\n")
    assert [(p.line, p.path) for p in found] == [(4, "hosts.0.gpus.0.id"), (5, "hosts.0.gpus.1.memory_gb")]


def test_nvlink_peer_must_be_a_gpu_of_the_host():
    (p,) = problems("hosts:\n  - name: h\n    gpus:\n      - {id: 0, nvlink: [3]}\n")
    assert p.line == 4 and "peer 3" in p.message


def test_duplicate_gpu_ids_and_host_names_are_rejected():
    assert "twice" in problems("hosts:\n  - name: h\n    gpus: [{id: 0}, {id: 0}]\n")[0].message
    assert "twice" in problems("hosts:\n  - {name: h, cpus: 1}\n  - {name: h, cpus: 1}\n")[0].message


def test_nvlink_links_count_both_ways_and_nvswitch_links_all():
    inv = DeclaredInventory.from_text("hosts:\n  - name: h\n    gpus: [{id: 0, nvlink: [1]}, {id: 1}, {id: 2}]\n")
    assert inv.hosts[0].devices[1].nvlink_peers == {0}
    inv = DeclaredInventory.from_text("hosts:\n  - name: h\n    nvswitch: true\n    gpus: [{id: 0}, {id: 1}, {id: 2}]\n")
    assert inv.hosts[0].devices[2].nvlink_peers == {0, 1}


def test_compute_capability_reads_as_string_or_number():
    inv = DeclaredInventory.from_text('hosts: [{name: h, gpus: [{id: 0, compute_capability: 8.6}, {id: 1, compute_capability: "7.0"}]}]')
    assert [d.compute_capability for d in inv.hosts[0].devices.values()] == [(8, 6), (7, 0)]
    assert "major.minor" in problems('hosts: [{name: h, gpus: [{id: 0, compute_capability: "sm80"}]}]')[0].message


def test_cuda_visible_devices_of_a_declared_host_maps_logical_ids():
    inv = DeclaredInventory.from_text('hosts: [{name: h, cuda_visible_devices: "3,1", gpus: [{id: 0}, {id: 1}, {id: 2}, {id: 3}]}]')
    assert inv.hosts[0].physical(0) == 3 and inv.hosts[0].logical(1) == 1


def test_cpu_only_host_and_errors_are_graph_errors():
    inv = DeclaredInventory.from_text("hosts: [{name: box, cpus: 4}]")
    assert inv.device_type == "cpu" and inv.hosts[0].visible == [0, 1, 2, 3]
    with pytest.raises(GraphError, match="neither"):
        DeclaredInventory.from_text("hosts: [{name: box}]")


def test_missing_file_and_bad_yaml_are_clean_errors(tmp_path):
    with pytest.raises(InventoryError, match="cannot read"):
        DeclaredInventory.load(tmp_path / "nope.yaml")
    with pytest.raises(GraphError, match="not valid YAML"):
        DeclaredInventory.from_text("hosts: [", "x.yaml")
