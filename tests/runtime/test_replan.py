"""A lost host (flowrl/runtime/controller/replan.py): its processes are re-planned onto the hosts that are left,
their links decided again, the move written to the ledger; or, when nothing left fits, the run's
failure names the lost host and why. Fakes for the controller and the launcher; the real thing
runs in tests/ray (test_launcher.py, test_two_hosts.py)."""

from __future__ import annotations

import types

import pytest

from flowrl.graph import load_graph
from flowrl.graph.structure import node_classes
from flowrl.ray_cluster import RayNode
from flowrl.runtime.protocol.addresses import Network
from flowrl.runtime.protocol.procspec import ProcSpec
from flowrl.runtime.protocol.ledger import Replanned
from flowrl.runtime.controller import replan

N = "flowrl.testing.nodes"
A = RayNode("host-a", "a" * 56, "127.0.0.1", {"CPU": 2})
C = RayNode("host-c", "c" * 56, "127.0.0.3", {"CPU": 1})


class Launcher:
    def __init__(self, live: list[RayNode], lost: RayNode):
        self.live, self.lost = live, lost

    def lost_node(self, host):
        return self.lost

    def host_address(self, host):
        return next(n.address for n in self.live if n.name == host)

    def inventory(self):
        from flowrl.placement.ray_inventory import RayInventory

        return RayInventory.from_nodes(self.live, "127.0.0.1:6379")


def controller(tmp_path, scale: str, live: list[RayNode]):
    path = tmp_path / "g.yaml"
    path.write_text(f"""\
nodes:
  numbers: {{kind: "{N}:Numbers", host: host-a}}
  scale: {{kind: "{N}:Scale", host: host-c{scale}}}
  collect: {{kind: "{N}:Collect", host: host-a}}
edges: [numbers -> scale, scale -> collect]
""")
    spec = load_graph(path, check=False)
    net = Network(spec, {}, tmp_path / "socks", "127.0.0.1")
    hosts = {"numbers": "host-a", "scale": "host-c", "collect": "host-a"}
    procs = []
    for node, host in hosts.items():
        pid = f"{node}/0/0"
        net.place(pid, {"host-a": "127.0.0.1", "host-c": "127.0.0.3"}[host])
    for node, host in hosts.items():
        inputs = {"in": net.input_address(node, 0, "in")} if node != "numbers" else {}
        procs.append(types.SimpleNamespace(id=f"{node}/0/0", spec=ProcSpec(
            node=node, kind="x", replica=0, replicas=1, rank=0, world_size=1, incarnation=1, run_dir="r",
            graph_file="g", control="ipc://c", inputs=inputs, host=host, host_address=net.where[f"{node}/0/0"])))
    ledger = []
    return types.SimpleNamespace(launcher=Launcher(live, C), procs=procs, spec=spec, classes=node_classes(spec),
                                 net=net, ledger=types.SimpleNamespace(record=ledger.append),
                                 rows=ledger)


def move_off(c, lost: str):
    """replan.move_off given the fakes' parts, as the controller gives its components."""
    return replan.move_off(lost, launcher=c.launcher, procs=c.procs, spec=c.spec, classes=c.classes, net=c.net,
                           ledger=c.ledger)


def test_the_processes_of_a_lost_host_move_to_one_that_is_left_and_their_links_are_decided_again(tmp_path):
    c = controller(tmp_path, "", [A])
    scale = next(p for p in c.procs if p.spec.node == "scale")
    assert scale.spec.inputs["in"] == "tcp://127.0.0.3:0"  # fed from host-a
    assert move_off(c, "host-c") is None
    assert scale.spec.host == "host-a" and scale.spec.host_address == "127.0.0.1" and scale.spec.devices
    assert scale.spec.inputs["in"].startswith("ipc://")  # its producer shares its new host
    assert scale.spec.input_clients == {} and scale.spec.control.startswith("ipc://")
    assert c.rows == [Replanned(host="host-c", moved={"scale/0/0": "host-a"})]


def test_a_lost_host_whose_processes_fit_nowhere_fails_the_run_naming_the_host_and_why(tmp_path):
    gpu = RayNode("host-a", "a" * 56, "127.0.0.1", {"CPU": 4, "GPU": 1})
    c = controller(tmp_path, ", devices: 2", [gpu])
    why = move_off(c, "host-c")
    assert why is not None
    assert why.startswith("Ray node 'host-c' (127.0.0.3, node id cccccccc) is gone, and its processes (scale/0/0) "
                          "fit on no host that is left (host-a): not-enough-devices: node `scale` needs 2 GPUs"), why
    assert "flowrl run --resume" in why and c.rows == []


@pytest.mark.parametrize("down", [RuntimeError("the Ray cluster at 127.0.0.1:6379 has no live node")])
def test_a_cluster_that_cannot_be_read_fails_the_run_naming_the_host(tmp_path, down):
    c = controller(tmp_path, "", [A])

    def broken():
        raise down

    c.launcher.inventory = broken
    assert move_off(c, "host-c") == ("Ray node 'host-c' (127.0.0.3, node id cccccccc) is gone, and its processes "
                                     "cannot be re-planned: the Ray cluster at 127.0.0.1:6379 has no live node")


def test_a_replica_with_ranks_on_the_lost_host_is_planned_again_whole_with_its_group_on_the_host_left(tmp_path):
    path = tmp_path / "g.yaml"
    path.write_text(f"""\
nodes:
  numbers: {{kind: "{N}:Numbers", host: host-a}}
  scale: {{kind: "{N}:Scale", devices: 4}}
  collect: {{kind: "{N}:Collect", host: host-a}}
edges: [numbers -> scale, scale -> collect]
""")
    spec = load_graph(path, check=False)
    net = Network(spec, {}, tmp_path / "socks", "127.0.0.1")
    where = {"numbers/0/0": "host-a", "collect/0/0": "host-a", "scale/0/0": "host-a", "scale/0/1": "host-a",
             "scale/0/2": "host-c", "scale/0/3": "host-c"}
    address = {"host-a": "127.0.0.1", "host-c": "127.0.0.3"}
    for pid, host in where.items():
        net.place(pid, address[host])
    ports = iter(range(9001, 9100))
    links = net.rank_links("scale", 0, 4, lambda host: next(ports))
    assert links[0][2].startswith("tcp://127.0.0.3:")
    procs = []
    for pid, host in where.items():
        node, _, rank = pid.split("/")
        procs.append(types.SimpleNamespace(id=pid, spec=ProcSpec(
            node=node, kind="x", replica=0, replicas=1, rank=int(rank), world_size=4 if node == "scale" else 1,
            incarnation=1, run_dir="r", graph_file="g", control="ipc://c", host=host, host_address=address[host],
            inputs={"in": net.input_address(node, 0, "in")} if node != "numbers" else {},
            env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, rank_addresses=links[0], rank_keys=links[1])))
    launcher = Launcher([A], C)
    launcher.free_port = lambda address: 4242 if address == "127.0.0.1" else pytest.fail(f"a port on {address}")
    relinked = []

    def relink(group):
        relinked.append(sorted(p.id for p in group))
        addresses, keys = net.rank_links("scale", 0, 4, launcher.free_port)
        for p in group:
            p.spec.rank_addresses, p.spec.rank_keys = addresses, keys

    rows = []
    why = replan.move_off("host-c", launcher=launcher, procs=procs, spec=spec, classes=node_classes(spec), net=net,
                          ledger=types.SimpleNamespace(record=rows.append), relink=relink)
    assert why is None
    scale = [p for p in procs if p.spec.node == "scale"]
    assert rows == [Replanned(host="host-c", moved={"scale/0/2": "host-a", "scale/0/3": "host-a"})]
    assert {p.spec.host for p in scale} == {"host-a"} and relinked == [[f"scale/0/{r}" for r in range(4)]]
    # one group again: every rank's store on host-a at the port picked there; shard channels ipc now
    assert {(p.spec.env["MASTER_ADDR"], p.spec.env["MASTER_PORT"], p.spec.env["WORLD_SIZE"]) for p in scale} == {
        ("127.0.0.1", "4242", "4")}
    assert all(a.startswith("ipc://") for a in scale[0].spec.rank_addresses) and set(scale[0].spec.rank_keys) == {""}
