"""`flowrl scale` on a run that spans hosts (flowrl/runtime/controller/crosshost.py, planfile.py): where
a new replica goes (free devices on the live cluster, a device a process has counts as used), the
refusal that names every host, the control admitting and then refusing a new process's key, and
RUN_DIR/plan.json rewritten with a `plan` event. The whole thing runs in
tests/ray/test_scale_two_hosts.py; here fakes stand for the launcher and the controller."""

from __future__ import annotations

import json
import types

import anyio
import pytest

from flowrl.graph import load_graph
from flowrl.graph.structure import node_classes
from flowrl.placement.plan import PlanEntry
from flowrl.ray_cluster import RayNode
from flowrl.runtime.controller.crosshost import admit, place_replicas
from flowrl.runtime.controller.planfile import PlanFile
from flowrl.runtime.protocol import messages as m
from flowrl.runtime.protocol.addresses import Network, admit_control, bind_control, release_control
from flowrl.runtime.protocol.ledger import PlanChanged
from tests.curve_probe import handshake

pytestmark = pytest.mark.timeout(60)
N = "flowrl.testing.nodes"
ADDRESS = {"host-a": "127.0.0.1", "host-b": "127.0.0.2"}
HOSTS = [RayNode("host-a", "a" * 56, "127.0.0.1", {"CPU": 2}), RayNode("host-b", "b" * 56, "127.0.0.2", {"CPU": 2})]


def entry(node: str, replica: int, host: str, core: int) -> PlanEntry:
    return PlanEntry(node, replica, 0, 0, 1, host, [core], [core], "cpu", ADDRESS[host], None, [1], [0], [])


def fake_wiring(tmp_path, placed: dict[str, tuple[str, int]], pin: str = ""):
    """numbers -> scale -> collect, each process at (host, core); the launcher sees HOSTS."""
    from flowrl.placement.ray_inventory import RayInventory

    path = tmp_path / "g.yaml"
    path.write_text(f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  scale: {{kind: "{N}:Scale"{pin}}}
  collect: {{kind: "{N}:Collect"}}
edges: [numbers -> scale, scale -> collect]
""")
    spec = load_graph(path)  # checked: every edge names its ports
    net = Network(spec, {}, tmp_path, "127.0.0.1")
    entries = []
    for pid, (host, core) in placed.items():
        node, replica, _ = pid.split("/")
        net.place(pid, ADDRESS[host])
        entries.append(entry(node, int(replica), host, core))
    net.control_tcp = "tcp://127.0.0.1:1"  # the run started on both hosts
    launcher = types.SimpleNamespace(inventory=lambda: RayInventory.from_nodes(HOSTS, "127.0.0.1:6379"))
    return types.SimpleNamespace(spec=spec, net=net, plan=types.SimpleNamespace(entries=entries), launcher=launcher,
                                 facts=None, address=net.input_address, classes=node_classes(spec))


def test_a_new_replica_goes_to_the_host_with_free_devices_then_time_shares_the_least_loaded_one(tmp_path):
    # host-a: both cores taken; host-b: core 0 taken (collect), core 1 free; collect's input is tcp already
    w = fake_wiring(tmp_path, {"numbers/0/0": ("host-a", 0), "scale/0/0": ("host-a", 1), "collect/0/0": ("host-b", 0)})
    entries, why = place_replicas(w, "scale", 2)
    assert why is None
    assert [(e.node, e.replica, e.host, e.devices, e.master_addr) for e in entries] == [("scale", 1, "host-b", [1], "127.0.0.2")]
    # two more: no core is free any more (the one just chosen counts as used): CPU cores are time-shared,
    # each on the host whose cores carry the least weight then
    entries, why = place_replicas(w, "scale", 4)
    assert why is None and [(e.replica, e.host) for e in entries] == [(1, "host-b"), (2, "host-a"), (3, "host-b")]


def test_no_host_a_replica_may_go_to_is_refused_naming_every_host_and_why(tmp_path):
    # collect shares host-a with scale/0: its input is ipc, so a replica on host-b could not reach it
    w = fake_wiring(tmp_path, {"numbers/0/0": ("host-a", 0), "scale/0/0": ("host-a", 1), "collect/0/0": ("host-a", 0)})
    entries, why = place_replicas(w, "scale", 2)
    assert [e.host for e in entries] == ["host-a"]  # host-b is out; host-a's cores are shared
    pinned = fake_wiring(tmp_path, {"numbers/0/0": ("host-a", 0), "scale/0/0": ("host-b", 1),
                                    "collect/0/0": ("host-b", 0)}, pin=", host: host-b")
    pinned.net.control_tcp = None  # as if the run had started on one host: no tcp control to reach
    entries, why = place_replicas(pinned, "scale", 2)
    assert entries == [] and why.startswith("no host has room for scale/1 (1 free cpu device(s)"), why
    assert "host-a: 1 of 2 cpu device(s) free (scale is pinned to host-b)" in why, why
    assert "host-b: 0 of 2 cpu device(s) free (the run's control is on its one host only)" in why, why
    assert "Fix: add a host" in why
    ipc = fake_wiring(tmp_path, {"numbers/0/0": ("host-a", 0), "scale/0/0": ("host-a", 1),
                                 "collect/0/0": ("host-a", 0)}, pin=", host: host-b")
    entries, why = place_replicas(ipc, "scale", 2)
    assert entries == [] and "host-b: 2 of 2 cpu device(s) free (collect/0 on another host takes its input over ipc)" in why


def test_the_control_admits_a_new_process_key_then_refuses_it_once_revoked(tmp_path):
    w = fake_wiring(tmp_path, {"numbers/0/0": ("host-a", 0), "scale/0/0": ("host-b", 1), "collect/0/0": ("host-a", 0)})
    net = w.net
    net.control_tcp = None
    zctx, router = bind_control(net)
    try:
        net.place("scale/1/0", "127.0.0.2")  # a replica `flowrl scale` adds: a fresh key pair
        new = net.keys["scale/1/0"]
        assert handshake(net.control_tcp, net.control_keys[0], new, send=None) == "refused"
        admit_control(net, add=[new[0]])
        assert handshake(net.control_tcp, net.control_keys[0], new, send=None) == "succeeded"
        admit_control(net, remove=[new[0]])
        assert handshake(net.control_tcp, net.control_keys[0], new, send=None) == "refused"
        assert handshake(net.control_tcp, net.control_keys[0], net.keys["scale/0/0"], send=None) == "succeeded"
        assert handshake(net.control_tcp, net.control_keys[0]) == "refused"  # a made-up key, as ever
    finally:
        router.close(0)
        release_control(net, zctx)


def test_consumers_with_a_curve_input_are_told_to_admit_then_refuse_a_producer(tmp_path):
    w = fake_wiring(tmp_path, {"numbers/0/0": ("host-a", 0), "scale/0/0": ("host-a", 1), "collect/0/0": ("host-b", 0)})
    w.net.control_tcp = None  # (no control socket here: the order to the consumer is the point)
    collect = types.SimpleNamespace(id="collect/0/0", spec=types.SimpleNamespace(
        rank=0, input_clients={"in": w.net.input_clients("collect", 0, "in")}))
    procs = types.SimpleNamespace(of_node=lambda node: [collect] if node == "collect" else [])
    sent = []

    async def send(proc, msg):
        sent.append((proc.id, msg))
        return True

    w.net.place("scale/1/0", "127.0.0.2")
    key = w.net.keys["scale/1/0"][0]
    anyio.run(lambda: admit(w, procs, send, "scale/1/0"))
    assert sent == [("collect/0/0", m.Admit(port="in", add=[key]))] and key in collect.spec.input_clients["in"]
    anyio.run(lambda: admit(w, procs, send, "scale/1/0", add=False))
    assert sent[-1] == ("collect/0/0", m.Admit(port="in", remove=[key])) and key not in collect.spec.input_clients["in"]


def test_plan_json_is_rewritten_with_each_change_and_the_ledger_keeps_the_history(tmp_path):
    from flowrl.placement.plan import Plan

    plan = Plan([entry("scale", 0, "host-a", 0)], [])
    rows = []
    planfile = PlanFile(tmp_path, plan, types.SimpleNamespace(record=rows.append))
    plan.entries.append(entry("scale", 1, "host-b", 1))
    planfile.changed("scale scale 1 -> 2", added={"scale/1/0": "host-b"})
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["revision"] == 1 and [(e["replica"], e["host"]) for e in data["plan"]] == [(0, "host-a"), (1, "host-b")]
    assert Plan.from_json(data).entries == plan.entries  # --resume reads it back
    plan.entries = plan.entries[:1]
    planfile.changed("scale scale 2 -> 1", removed=["scale/1/0"])
    assert [(e["replica"]) for e in json.loads((tmp_path / "plan.json").read_text())["plan"]] == [0]
    assert rows == [PlanChanged(revision=1, why="scale scale 1 -> 2", added={"scale/1/0": "host-b"}, removed=[], moved={}),
                    PlanChanged(revision=2, why="scale scale 2 -> 1", added={}, removed=["scale/1/0"], moved={})]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left
