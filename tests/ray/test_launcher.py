"""The `ray` launcher for real: node processes under Ray actors on a two-node loopback cluster,
pinned to the hosts the plan chose, restarted after kill -9 (of the process or of its actor), and
nothing left behind — no process, no actor, no held resource — after a run or a Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from flowrl.ray_cluster import RayNode
from flowrl.runtime.protocol.errors import RunFailed
from flowrl.testing import audit_ledger, read_jsonl
from flowrl.testing.harness import flowrl_command, kill_group
from tests.ray.conftest import alive

N = "flowrl.testing.nodes"
PINNED = f"""\
name: pinned
nodes:
  numbers: {{kind: "{N}:Numbers", host: host-a}}
  scale: {{kind: "{N}:Scale", replicas: 2, host: host-b, config: {{delay_s: 0.2}}}}
  collect: {{kind: "{N}:Collect", host: host-a}}
edges:
  - numbers -> scale
  - scale -> collect
schedule: {{steps: STEPS, batch_size: 4, max_staleness: 3}}
supervision: {{heartbeat_s: 0.2, deadline_s: 5.0}}
launcher: {{type: ray, address: "ADDRESS"}}
"""


# ----------------------------------------------------------------------------------- no cluster
class FakeCluster:
    owned = False

    def __init__(self, nodes, local):
        self._nodes, self.local = nodes, local

    def nodes(self):
        return self._nodes

    def local_node_id(self):
        return self.local

    def close(self):
        pass


def launcher_on(nodes, local_id):
    pytest.importorskip("ray")
    from flowrl.runtime.launch.ray_launcher import RayLauncher

    return RayLauncher(cluster=FakeCluster(nodes, local_id))


A = RayNode("host-a", "a" * 56, "127.0.0.1", {"CPU": 2})
B = RayNode("host-b", "b" * 56, "127.0.0.1", {"CPU": 2})
FAR = RayNode("far", "f" * 56, "10.0.0.9", {"CPU": 8})


def entry(node, host, devices, device_type="cpu", replica=0):
    return {"node": node, "replica": replica, "rank": 0, "host": host, "devices": devices, "device_type": device_type}


def test_each_process_asks_ray_for_its_share_of_the_cores_the_plan_gave_it():
    from flowrl.runtime.launch.ray_launcher import RayLauncher

    entries = {(e["node"], 0, 0): e for e in (entry("a", "h", [0]), entry("b", "h", [0]), entry("c", "h", [0]),
                                              entry("d", "h", [1]), entry("e", "g", [0]))}
    assert RayLauncher.resources(entries["a", 0, 0], entries) == {"num_cpus": 0.3333}  # 3 share core 0 of h
    assert RayLauncher.resources(entries["d", 0, 0], entries) == {"num_cpus": 1.0}
    assert RayLauncher.resources(entries["e", 0, 0], entries) == {"num_cpus": 1.0}  # core 0 of another host
    gpu = entry("t", "h", [2, 3], "cuda")
    assert RayLauncher.resources(gpu, {("t", 0, 0): gpu}) == {"num_cpus": 0, "num_gpus": 2}


def test_hosts_map_to_ray_nodes_and_localhost_to_the_controllers_node():
    launcher = launcher_on([A, B], B.node_id)
    assert launcher.node_for("host-a", "x/0/0") is A
    assert launcher.node_for("localhost", "x/0/0") is B  # a plan on this machine's cores
    with pytest.raises(RunFailed, match=r"host 'nowhere', which is not a node of the Ray cluster \(nodes: host-a, host-b\)"):
        launcher.node_for("nowhere", "x/0/0")


def test_a_plan_that_needs_more_cpus_than_its_ray_node_offers_is_refused_before_anything_starts():
    one_cpu = RayNode("solo", "c" * 56, "127.0.0.1", {"CPU": 1})
    launcher = launcher_on([one_cpu], one_cpu.node_id)
    entries = {(n, 0, 0): entry(n, "localhost", [core]) for n, core in (("a", 0), ("b", 1), ("c", 1))}
    with pytest.raises(RunFailed, match=r"needs 2 CPUs on Ray node 'solo', which offers 1; .* --num-cpus 2"):
        launcher.check_fits(entries)
    launcher.check_fits({k: v for k, v in entries.items() if k[0] == "a"})  # one core's worth fits


def test_a_host_on_another_machine_is_placed_there_and_its_links_use_its_ray_node_address():
    launcher = launcher_on([A, FAR], A.node_id)
    assert launcher.node_for("far", "x/0/0") is FAR
    assert launcher.host_address("far") == "10.0.0.9"
    assert launcher.host_address("localhost") == launcher.controller_address() == "127.0.0.1"


def test_make_launcher_refuses_a_ray_client_address_with_the_reason():
    pytest.importorskip("ray")
    from flowrl.ray_cluster import RayCluster, RayClusterError

    with pytest.raises(RayClusterError, match="Ray Client address.*launcher.address=auto"):
        RayCluster.connect("ray://127.0.0.1:10001")


# ---------------------------------------------------------------------------------- on the cluster
def node_processes(run_dir: Path) -> dict[str, int]:
    """log name (`scale.1.0`) -> PID of the live node process started for this run."""
    import psutil

    procs = str(run_dir / "procs") + "/"
    out = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if len(cmd) >= 4 and cmd[-2] == "flowrl.runtime.worker" and cmd[-1].startswith(procs):
            out[Path(cmd[-1]).name[:-len(".json")]] = p.info["pid"]
    return out


def host_of(pid: int, raylets: dict[str, int]) -> str | None:
    """The Ray node (host) whose raylet the process descends from."""
    import psutil

    by_pid = {v: k for k, v in raylets.items()}
    for parent in psutil.Process(pid).parents():
        if parent.pid in by_pid:
            return by_pid[parent.pid]
    return None


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)  # polling files and the process table for progress, not ordering events
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def wired(run_dir: Path, names) -> bool:
    logs = run_dir / "logs"
    return all((logs / f"{n}.log").exists() and "wired" in (logs / f"{n}.log").read_text(errors="replace")
               for n in names)


def assert_cluster_released_everything():
    """No FlowrlNodeProcess actor alive, no placement group, every CPU of the cluster free again."""
    import ray

    def released():
        actors = [a for a in ray._private.state.actors().values()
                  if a.get("ActorClassName", "").endswith("FlowrlNodeProcess") and a.get("State") != "DEAD"]
        return not actors and ray.available_resources().get("CPU") == ray.cluster_resources().get("CPU")

    wait_for(released, 30, "the cluster to drop every flowrl actor and free its CPUs")
    assert ray.util.placement_group_table() == {}


ALL = ["numbers.0.0", "scale.0.0", "scale.1.0", "collect.0.0"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_graph_pinned_to_two_ray_hosts_runs_there_and_survives_kill_9_of_a_process_and_of_an_actor(ray_cluster, tmp_path):
    import psutil

    cluster, raylets = ray_cluster
    graph = tmp_path / "g.yaml"
    graph.write_text(PINNED.replace("STEPS", "40").replace("ADDRESS", cluster.address))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(flowrl_command(graph, run_dir, extra=["--inventory", f"ray:{cluster.address}"]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pids = wait_for(lambda: (p := node_processes(run_dir)) and set(p) == set(ALL) and wired(run_dir, ALL) and p,
                        150, "every node process to start and wire")
        assert {name: host_of(pid, raylets) for name, pid in pids.items()} == {
            "numbers.0.0": "host-a", "collect.0.0": "host-a", "scale.0.0": "host-b", "scale.1.0": "host-b"}
        wait_for(lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= 3, 60, "progress")
        actor_pid = psutil.Process(pids["scale.1.0"]).ppid()
        assert "FlowrlNodeProcess" in " ".join(psutil.Process(actor_pid).cmdline())
        started = pids.values()
        ours = set(started) | {psutil.Process(p).ppid() for p in started}
        os.kill(pids["scale.0.0"], signal.SIGKILL)  # the node process: its actor reports the exit status
        os.kill(actor_pid, signal.SIGKILL)  # the actor: Ray's actor-death notice, and its child dies with it
        out, err = proc.communicate(timeout=180)
    finally:
        kill_group(proc.pid)
        proc.wait()
    assert proc.returncode == 0, err[-3000:]
    audit = audit_ledger(read_jsonl(run_dir / "ledger.jsonl"))
    assert audit.exactly_once and len(audit.issued) == 40, (audit.lost, audit.duplicated)
    for name in ("scale.0.0", "scale.1.0"):
        assert "(incarnation 1)" in (run_dir / "logs" / f"{name}.log").read_text(), name  # restarted
    assert alive(ours) == []
    assert_cluster_released_everything()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ctrl_c_under_the_ray_launcher_stops_every_process_and_actor(ray_cluster, tmp_path):
    import psutil

    cluster, _ = ray_cluster
    graph = tmp_path / "g.yaml"
    graph.write_text(PINNED.replace("STEPS", "1000").replace("ADDRESS", cluster.address))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(flowrl_command(graph, run_dir, extra=["--inventory", f"ray:{cluster.address}"]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for(lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= 2, 150, "progress")
        pids = node_processes(run_dir)
        ours = set(pids.values()) | {psutil.Process(p).ppid() for p in pids.values()}
        assert len(pids) == 4
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        kill_group(proc.pid)
        proc.wait()
    assert proc.returncode == 130, err[-3000:]
    wait_for(lambda: not alive(ours), 10, "every node process and actor to be gone")
    assert_cluster_released_everything()
    assert json.loads((run_dir / "plan.json").read_text())["plan"][0]["host"] == "host-a"


def test_a_lost_ray_node_is_named_when_a_process_cannot_restart_on_it():
    launcher = launcher_on([A, B], A.node_id)
    launcher.nodes = {"host-a": A}  # host-b left the cluster
    with pytest.raises(RunFailed, match=r"Ray node 'host-b' \(127.0.0.1, node id bbbbbbbb\) is gone, so x/0/0 cannot"):
        launcher.node_for("host-b", "x/0/0")
    launcher.cluster._nodes = [A]
    assert launcher.is_lost("host-b") and not launcher.is_lost("host-a") and not launcher.is_lost("localhost")


LOST = f"""\
name: lost
nodes:
  numbers: {{kind: "{N}:Numbers", host: host-a}}
  scale: {{kind: "{N}:Scale", host: host-c, config: {{delay_s: 0.2}}}}
  collect: {{kind: "{N}:Collect", host: host-a}}
edges: [numbers -> scale, scale -> collect]
schedule: {{steps: 1000, batch_size: 4, max_staleness: 3}}
supervision: {{heartbeat_s: 0.2, deadline_s: 5.0}}
launcher: {{type: ray, address: "ADDRESS"}}
"""


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_removing_a_ray_node_moves_its_processes_to_a_host_that_is_left_exactly_once(ray_cluster, tmp_path):
    import psutil

    from flowrl.ray_cluster import loopback_node_args

    cluster, _ = ray_cluster
    node_c = cluster.add_node(**loopback_node_args(num_cpus=1, node_name="host-c",
                                                   temp_dir=cluster.head_node.get_temp_dir_path()))
    graph = tmp_path / "g.yaml"
    graph.write_text(LOST.replace("ADDRESS", cluster.address).replace("1000", "30"))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(flowrl_command(graph, run_dir, extra=["--inventory", f"ray:{cluster.address}"]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for(lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= 2, 150, "progress")
        pids = node_processes(run_dir)
        ours = set(pids.values()) | {psutil.Process(p).ppid() for p in pids.values()}
        cluster.remove_node(node_c)  # the whole host goes: raylet, its workers, the actor, the node process
        moved = wait_for(lambda: (p := node_processes(run_dir)).get("scale.0.0") not in (None, pids["scale.0.0"]) and p,
                         90, "scale to start again on another host")
        ours |= set(moved.values()) | {psutil.Process(p).ppid() for p in moved.values()}
        out, err = proc.communicate(timeout=90)
    finally:
        kill_group(proc.pid)
        proc.wait()
    assert proc.returncode == 0, err[-3000:]
    ledger = read_jsonl(run_dir / "ledger.jsonl")
    replans = [r for r in ledger if r["event"] == "replanned"]
    assert len(replans) == 1 and replans[0]["host"] == "host-c", replans
    assert replans[0]["moved"]["scale/0/0"] in ("host-a", "host-b")
    assert "replanned host-c lost: scale/0/0 -> host-" in out  # the live view says so
    audit = audit_ledger(ledger)
    assert audit.exactly_once and len(audit.issued) == 30, (audit.lost, audit.duplicated)
    wait_for(lambda: not alive(ours), 10, "every node process and actor to be gone")
    assert_cluster_released_everything()


def test_flowrl_run_with_a_ray_address_where_no_cluster_answers_exits_2_naming_it(tmp_path):
    from tests.ray.test_inventory import closed_port

    address = f"127.0.0.1:{closed_port()}"
    graph = tmp_path / "g.yaml"
    graph.write_text(f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  collect: {{kind: "{N}:Collect"}}
edges: [numbers -> collect]
launcher: {{type: ray, address: "{address}"}}
""")
    out = subprocess.run(flowrl_command(graph, tmp_path / "run"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"no Ray cluster answers at {address}" in out.stderr and "launcher.address=null" in out.stderr
