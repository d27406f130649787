"""`--inventory ray[:ADDRESS]`: the live Ray nodes are the hosts the planner places on."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flowrl.graph import load_graph
from flowrl.placement import InventoryError, get_inventory, make_plan
from flowrl.placement.ray_inventory import RayInventory
from flowrl.ray_cluster import RayNode, ray_nodes
from tests.ray.conftest import HOSTS

pytestmark = pytest.mark.timeout(120)

PINNED = """\
name: pinned
nodes:
  numbers: {kind: "flowrl.testing.nodes:Numbers", host: host-b}
  collect: {kind: "flowrl.testing.nodes:Collect", host: host-a}
edges: [numbers -> collect]
"""


def test_ray_inventory_has_each_node_as_a_host_with_its_cpus_and_custom_resources(ray_cluster):
    cluster, _ = ray_cluster
    inv = get_inventory(f"ray:{cluster.address}")
    assert isinstance(inv, RayInventory) and inv.device_type == "cpu"
    assert [h.name for h in inv.hosts] == list(HOSTS)
    assert [h.visible for h in inv.hosts] == [[0, 1], [0, 1]]
    assert {h.address for h in inv.hosts} == {"127.0.0.1"}
    assert inv.resources == {"host-a": {"host_a": 1.0}, "host-b": {"host_b": 1.0}}
    assert "2 hosts, 4 CPU cores" in inv.describe()


def test_plan_on_the_ray_inventory_puts_nodes_on_the_hosts_the_graph_names(ray_cluster, tmp_path):
    cluster, _ = ray_cluster
    (tmp_path / "g.yaml").write_text(PINNED)
    plan = make_plan(load_graph(tmp_path / "g.yaml"), get_inventory(f"ray:{cluster.address}"))
    assert plan.ok, plan.findings
    assert {e.node: e.host for e in plan.entries} == {"numbers": "host-b", "collect": "host-a"}


@pytest.mark.slow
def test_flowrl_check_with_inventory_ray_prints_the_plan_on_the_cluster(ray_cluster, tmp_path):
    cluster, _ = ray_cluster
    (tmp_path / "g.yaml").write_text(PINNED)
    out = subprocess.run([sys.executable, "-m", "flowrl", "check", str(tmp_path / "g.yaml"), "--json",
                          "--inventory", f"ray:{cluster.address}"], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads(out.stdout)["plan"]
    assert {e["node"]: e["host"] for e in plan} == {"numbers": "host-b", "collect": "host-a"}


def test_gpu_nodes_are_gpu_hosts_and_a_cpu_only_head_is_left_out():
    nodes = [RayNode("head", "a" * 56, "10.0.0.1", {"CPU": 8}),
             RayNode("gpu-1", "b" * 56, "10.0.0.2", {"CPU": 32, "GPU": 4, "accelerator_type:A100": 1, "rack_7": 1})]
    inv = RayInventory.from_nodes(nodes, "10.0.0.1:6379")
    assert inv.device_type == "cuda" and [h.name for h in inv.hosts] == ["gpu-1"]
    host = inv.hosts[0]
    assert host.visible == [0, 1, 2, 3] and host.devices[0].name == "A100" and host.address == "10.0.0.2"
    assert inv.resources == {"gpu-1": {"rack_7": 1}}
    assert "left out, no GPU: head" in inv.source


def test_ray_nodes_sharing_a_name_get_their_node_id_appended_and_dead_nodes_are_dropped():
    raw = [{"Alive": True, "NodeName": "127.0.0.1", "NodeID": "ab" * 28, "NodeManagerAddress": "127.0.0.1",
            "Resources": {"CPU": 1}},
           {"Alive": True, "NodeName": "127.0.0.1", "NodeID": "cd" * 28, "NodeManagerAddress": "127.0.0.1",
            "Resources": {"CPU": 1}},
           {"Alive": False, "NodeName": "gone", "NodeID": "ef" * 28, "NodeManagerAddress": "127.0.0.1"}]
    assert [n.name for n in ray_nodes(raw)] == ["127.0.0.1-abababab", "127.0.0.1-cdcdcdcd"]


def test_an_empty_cluster_is_an_inventory_error_that_says_how_to_start_one():
    with pytest.raises(InventoryError, match="ray start --head"):
        RayInventory.from_nodes([], "auto")


def closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once it is closed


def test_flowrl_check_against_an_address_where_no_cluster_answers_exits_2_at_once(tmp_path):
    (tmp_path / "g.yaml").write_text(PINNED)
    address = f"127.0.0.1:{closed_port()}"
    out = subprocess.run([sys.executable, "-m", "flowrl", "check", str(tmp_path / "g.yaml"), "--inventory",
                          f"ray:{address}"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"no Ray cluster answers at {address}" in out.stderr and "ray start --head" in out.stderr
