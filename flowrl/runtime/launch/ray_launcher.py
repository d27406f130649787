"""The `ray` launcher: every node process runs under a Ray actor on the host the plan chose.

    launcher: {type: ray}                      # a private Ray cluster on 127.0.0.1, stopped at the end
    launcher: {type: ray, address: auto}       # the cluster `ray start --head` started on this machine
    flowrl run graph.yaml launcher.type=ray launcher.address=auto --inventory ray

Each process of the plan gets one `FlowrlNodeProcess` actor (flowrl/runtime/launch/ray_actor.py), pinned
with `NodeAffinitySchedulingStrategy(soft=False)` to the Ray node named like the plan entry's host
(the names `flowrl check --inventory ray` plans with), asking for `num_gpus` = its GPUs and for
its share of the CPU cores the plan gave it (a core shared by three processes counts a third for
each), so Ray's accounting matches the plan. The actor starts the same worker entry as the local
launchers (`python -m flowrl.runtime.worker SPEC`) as its child, so a node process is still a
process: `poll()` is its exit status, `signal()` reaches it, `kill -9` of its PID is a crash the
supervisor restarts. An actor that dies (killed, its Ray node gone) takes its child with it and
shows up in `poll()` as killed by SIGKILL; the cause Ray gave is logged.

Where a process runs: the entry's `host` in the ProcSpec (when the controller writes it), else the
run's plan.json. A host that is not a Ray node (`localhost`, from a plan on this machine's cores)
means the controller's own Ray node. Its links follow from the Ray nodes' addresses
(`host_address`, flowrl/runtime/protocol/addresses.py): ipc within a machine, tcp + CURVE between machines.
The ProcSpec travels in the actor call (the worker reads it from stdin), so its keys are never
written on the process's host.

A replica `flowrl scale` added: the controller rewrote plan.json with its entry first (the host it
chose); the launcher reads the file again for a process it does not know, and asks Ray for a CPU
per core of its own (a core it shares with a running process: nothing, those are counted already).

A lost Ray node: `is_lost(host)` tells the controller, which moves the node's processes to the
remaining hosts (flowrl/runtime/controller/replan.py) or fails the run naming the host. A moved process asks
Ray for its GPUs but for no CPU share (the host's CPUs are taken by the plan's own processes; it
time-shares the cores the re-plan gave it).

Clean ends: `close()` kills every actor this launcher created (each takes its child with it), then
leaves the cluster, and stops it when it started it. Actors are owned by the controller's Ray
driver, so if the controller dies Ray removes them too.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
from pathlib import Path

from flowrl.ray_cluster import RayCluster, RayNode, import_ray
from flowrl.runtime.launch import ray_actor
from flowrl.runtime.protocol.errors import RunFailed
from flowrl.runtime.protocol.procspec import WORKER_MODULE
from flowrl.runtime.launch.launcher import Launcher, ProcessHandle

log = logging.getLogger("flowrl.ray")
LOCAL_HOSTS = ("localhost", "127.0.0.1", None)


class RayProcessHandle(ProcessHandle):
    """A node process started by a `FlowrlNodeProcess` actor. Never blocks on Ray."""

    def __init__(self, actor, proc_id: str, node: RayNode, argv: list[str], log_path: str, env: dict, cwd: str,
                 stdin: str | None = None):
        self.actor = actor
        self.proc_id = proc_id
        self.node = node
        self.start_ref = actor.start.remote(argv, log_path, env, cwd, stdin)
        self.wait_ref = actor.wait.remote()
        self._pid: int | None = None
        self.code: int | None = None
        self.cause: str | None = None

    @property
    def pid(self) -> int | None:
        """The node process's PID on its host; None until the actor has started it (the controller
        learns it from READY either way)."""
        if self._pid is None and self._ready(self.start_ref):
            try:
                self._pid = import_ray().get(self.start_ref)
            except Exception:  # noqa: BLE001 - the actor died or could not start it: poll() says so
                self._pid = -1
        return self._pid if self._pid != -1 else None

    @pid.setter
    def pid(self, value) -> None:
        self._pid = value

    @staticmethod
    def _ready(ref) -> bool:
        ready, _ = import_ray().wait([ref], timeout=0)
        return bool(ready)

    def poll(self) -> int | None:
        if self.code is not None:
            return self.code
        if not self._ready(self.wait_ref):
            return None
        ray = import_ray()
        try:
            self.code = ray.get(self.wait_ref)
        except ray.exceptions.RayActorError as e:  # the actor died: its child died with it (PDEATHSIG)
            self.code = -signal.SIGKILL
            self.cause = str(e).strip().splitlines()[-1][:500] if str(e).strip() else type(e).__name__
            log.warning("%s: its Ray actor on %s died (%s)", self.proc_id, self.node.name, self.cause)
        except Exception as e:  # noqa: BLE001 - anything else Ray raises for the call
            self.code = 1
            self.cause = f"{type(e).__name__}: {e}"[:500]
            log.warning("%s: the Ray actor on %s failed: %s", self.proc_id, self.node.name, self.cause)
        self.release()
        return self.code

    def signal(self, sig: int) -> None:
        if self.code is not None:
            return
        if sig == signal.SIGKILL and not self._ready(self.start_ref):
            self.release()  # nothing started yet (or the actor is stuck): the actor goes, and poll() says so
            return
        self.actor.signal.remote(sig)  # fire and forget: poll() sees the result

    def release(self) -> None:
        """End the actor (its child, if still there, dies with it) and free its resources: on exit,
        and when the supervisor starts the next incarnation (a stop that gave up before the exit
        was seen would otherwise leave the actor holding the resources the next one needs)."""
        try:
            import_ray().kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass


class FailedStart(ProcessHandle):
    """A process the launcher could not start (its Ray node is gone): exit code 1 at once, and the
    reason in its log, so the supervisor's policy decides and the failure text shows why."""

    pid = None

    def __init__(self, log_path: str, reason: str):
        try:
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "a") as f:
                f.write(f"flowrl ray launcher: {reason}\n")
        except OSError:  # another host's folder (launcher.host_dirs): the controller's log says it
            log.warning("%s", reason)

    def poll(self) -> int:
        return 1

    def signal(self, sig: int) -> None:
        pass


class RayLauncher(Launcher):
    def __init__(self, address: str | None = None, *, cluster: RayCluster | None = None):
        if cluster is None:
            if address is None:
                print("flowrl: starting a private Ray cluster on 127.0.0.1 (launcher.address is null)", flush=True)
                from flowrl.placement.cpu import usable_cores

                cluster = RayCluster.start_local(num_cpus=len(usable_cores()))  # as many as the plan's cores
            else:
                cluster = RayCluster.connect(address)
        self.cluster = cluster
        ray = import_ray()
        ray.cloudpickle.register_pickle_by_value(ray_actor)  # Ray nodes need not import flowrl for the actor
        self.actor_cls = ray.remote(ray_actor.FlowrlNodeProcess)
        self.nodes = {n.name: n for n in cluster.nodes()}
        self.seen = dict(self.nodes)  # every node ever seen, to name one that is lost
        if cluster.owned:
            where = ", ".join(sorted({n.address for n in self.nodes.values()}))
            print(f"flowrl: Ray cluster {cluster.address} up, {len(self.nodes)} node(s) at {where}", flush=True)
        local_id = cluster.local_node_id()
        self.local = next((n for n in self.nodes.values() if n.node_id == local_id), None)
        self.handles: list[RayProcessHandle] = []
        self.plans: dict[str, dict] = {}
        self.added: set[tuple] = set()  # (run_dir, entry key) of replicas `flowrl scale` added
        root = str(Path(__file__).resolve().parents[3])
        self.env = {"PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}

    # where and how big ---------------------------------------------------------------------------
    def plan_entries(self, run_dir: str, key: tuple | None = None) -> dict:
        """(node, replica, rank) -> plan entry, from RUN_DIR/plan.json (read once per run, and again
        for a process it does not list: one `flowrl scale` added, the controller rewrote the file)."""
        if run_dir not in self.plans or (key is not None and key not in self.plans[run_dir]):
            try:
                data = json.loads((Path(run_dir) / "plan.json").read_text())["plan"]
            except (OSError, ValueError, KeyError):
                data = []
            known = self.plans.get(run_dir)
            entries = {(e["node"], e["replica"], e["rank"]): e for e in data}
            if known is not None:  # keep the entries the running processes started with; add the new ones
                self.added |= {(run_dir, k) for k in entries if k not in known}
                entries = {**entries, **known}
            self.plans[run_dir] = entries
        return self.plans[run_dir]

    def node_for(self, host: str | None, proc_id: str) -> RayNode:
        node = self.nodes.get(host) if host is not None else None
        if node is None and host in self.seen:
            lost = self.seen[host]
            raise RunFailed(f"Ray node {host!r} ({lost.address}, node id {lost.node_id[:8]}) is gone, so {proc_id} "
                            "cannot restart on it")
        if node is None and host not in LOCAL_HOSTS:
            raise RunFailed(f"the plan puts {proc_id} on host {host!r}, which is not a node of the Ray cluster "
                            f"(nodes: {', '.join(sorted(self.nodes)) or 'none'}); plan against the cluster with "
                            "--inventory ray (or ray:ADDRESS)")
        node = node or self.local
        if node is None:
            raise RunFailed("the controller does not run on a node of the Ray cluster; run flowrl on a cluster node")
        return node

    # where processes run (for addresses.py and replan.py) ------------------------------------------
    def host_address(self, host: str | None) -> str:
        return self.node_for(host, f"a process on {host}").address

    def free_port(self, address: str) -> int:
        """A port free on `address`, asked of the Ray node that has it (a task pinned there); the
        controller's own host answers here."""
        if self.local is not None and address == self.local.address or address in LOCAL_HOSTS:
            return super().free_port(address)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node = next((n for n in self.nodes.values() if n.address == address), None)
        if node is None:
            raise RunFailed(f"no live Ray node has the address {address} (nodes: "
                            f"{', '.join(f'{n.name} {n.address}' for n in self.nodes.values())}); cannot pick a port there")
        ray = import_ray()
        task = ray.remote(num_cpus=0, max_retries=0)(ray_actor.free_port).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node.node_id, soft=False))
        try:
            return int(ray.get(task.remote(address), timeout=60))
        except Exception as e:  # noqa: BLE001 - the node cannot answer: name it
            raise RunFailed(f"cannot pick a free port on Ray node {node.name!r} ({address}): "
                            f"{str(e).splitlines()[0][:200]}") from None

    def controller_address(self) -> str:
        if self.local is None:
            raise RunFailed("the controller does not run on a node of the Ray cluster; run flowrl on a cluster node")
        return self.local.address

    def refresh(self) -> None:
        self.nodes = {n.name: n for n in self.cluster.nodes()}
        self.seen.update(self.nodes)

    def is_lost(self, host: str | None) -> bool:
        if host not in self.seen:
            return False
        self.refresh()
        return host not in self.nodes

    def is_remote(self, host: str | None) -> bool:
        node = self.seen.get(host)
        return host not in LOCAL_HOSTS and node is not None and (self.local is None or node.node_id != self.local.node_id)

    def lost_node(self, host: str) -> RayNode:
        return self.seen[host]

    def inventory(self):
        from flowrl.placement.ray_inventory import RayInventory

        self.refresh()
        return RayInventory.from_nodes(list(self.nodes.values()), self.cluster.address or "ray")

    def check_fits(self, entries: dict) -> None:
        """Every process has a Ray node, and each node offers the CPUs and GPUs its processes ask for
        (else Ray would keep them pending until the start-up timeout, saying nothing)."""
        asked: dict[str, dict] = {}
        for e in entries.values():
            node = self.node_for(e["host"], f"{e['node']}/{e['replica']}/{e['rank']}")
            need = asked.setdefault(node.name, {"CPU": 0.0, "GPU": 0.0})
            res = self.resources(e, entries)
            need["CPU"] += res.get("num_cpus", 0)
            need["GPU"] += res.get("num_gpus", 0)
        for name, need in asked.items():
            have = self.nodes[name].resources
            for kind, flag in (("CPU", "--num-cpus"), ("GPU", "--num-gpus")):
                if need[kind] > have.get(kind, 0) + 1e-6:
                    raise RunFailed(f"the plan needs {need[kind]:g} {kind}s on Ray node {name!r}, which offers "
                                    f"{have.get(kind, 0):g}; plan against the cluster (--inventory ray) or start the "
                                    f"node with {flag} {math.ceil(need[kind])}")

    @staticmethod
    def resources(entry: dict | None, entries: dict) -> dict:
        """Ray resources for one process: its GPUs, and its share of each CPU core the plan gave it."""
        if entry is None:
            return {"num_cpus": 0}
        if entry["device_type"] == "cuda":
            return {"num_cpus": 0, "num_gpus": len(entry["devices"])}
        share = 0.0
        for core in entry["devices"]:
            users = sum(1 for e in entries.values() if e["host"] == entry["host"] and core in e["devices"])
            share += 1.0 / max(users, 1)
        return {"num_cpus": math.floor(share * 1e4) / 1e4}  # Ray counts in 1e-4 steps; never round up

    # the seam ----------------------------------------------------------------------------------------
    def start(self, spec_path: Path, log_path: Path) -> ProcessHandle:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        text = Path(spec_path).read_text()
        spec = json.loads(text)
        key = (spec["node"], spec["replica"], spec["rank"])
        proc_id = "/".join(map(str, key))
        fresh = spec["run_dir"] not in self.plans
        entries = self.plan_entries(spec["run_dir"], key)
        if fresh:  # refuse a plan the cluster cannot run before anything of it starts
            self.check_fits(entries)
        entry = entries.get(key)
        host = spec.get("host") or (entry or {}).get("host")
        moved = entry is not None and host != entry["host"]  # re-planned onto another host (replan.py)
        if spec.get("incarnation", 0) > 0:  # a restart: is its Ray node still there?
            self.refresh()
            try:
                node = self.node_for(host, proc_id)
            except RunFailed as e:  # inside the controller's loop: a failed start, judged by its policy
                log.warning("%s", e)
                return FailedStart(str(log_path), str(e))
        else:
            node = self.node_for(host, proc_id)  # before the loop: RunFailed ends the run with the reason
        res = self.resources(entry, entries)
        if moved:
            res = {"num_cpus": 0, **({"num_gpus": len(spec["devices"])} if spec["device_type"] == "cuda" else {})}
        elif (spec["run_dir"], key) in self.added and entry["device_type"] == "cpu":  # added while the run goes:
            others = [e for k, e in entries.items() if k != key and e["host"] == entry["host"]]  # a core it
            res = {"num_cpus": sum(1 for c in entry["devices"] if not any(c in e["devices"] for e in others))}  # shares: 0
        actor = self.actor_cls.options(
            **res, max_concurrency=4, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node.node_id, soft=False)).remote()
        argv = [sys.executable, "-m", WORKER_MODULE, str(spec_path)]
        env = {**self.env, "FLOWRL_SPEC_STDIN": "1", **({"FLOWRL_RAY_GPUS": "1"} if res.get("num_gpus") else {})}
        handle = RayProcessHandle(actor, proc_id, node, argv, str(log_path), env, os.getcwd(), stdin=text)
        self.handles = [h for h in self.handles if h.code is None] + [handle]
        log.info("%s -> Ray node %s (%s)", proc_id, node.name, node.node_id[:8])
        return handle

    def fetch_checkpoint(self, *, src_host: str | None, src: str, dst_host: str | None, dst: str, sha256: str,
                         size: int | None = None, timeout_s: float = 600.0) -> str:
        """Copy a checkpoint shard between Ray nodes: a task pinned to the target checks whether it
        is there already; else one pinned to the holder reads it and one pinned to the target writes
        it atomically after checking its sha256. "present" or "fetched"; CheckpointError otherwise."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from flowrl.runtime.protocol.checkpoints import CheckpointError

        ray = import_ray()
        self.refresh()

        def on(node: RayNode, fn):
            return ray.remote(fn).options(num_cpus=0, max_retries=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
                node_id=node.node_id, soft=False))

        try:
            target = self.node_for(dst_host, f"the checkpoint {dst}")
        except RunFailed as e:
            raise CheckpointError(str(e)) from None
        holder = self.nodes.get(src_host) if src_host not in LOCAL_HOSTS else self.local
        try:
            if ray.get(on(target, ray_actor.shard_digest).remote(dst), timeout=timeout_s) == sha256:
                return "present"
            if holder is None:
                gone = self.seen.get(src_host)
                what = f" ({gone.address}, node id {gone.node_id[:8]})" if gone else ""
                raise CheckpointError(f"Ray node {src_host!r}{what} is not in the cluster any more, and no other "
                                      "copy exists")
            data = on(holder, ray_actor.read_shard).remote(src)
            ray.get(on(target, ray_actor.write_shard).remote(dst, data, sha256), timeout=timeout_s)
        except ray.exceptions.RayError as e:
            cause = getattr(e, "cause", None) or e
            text = str(cause).strip().splitlines()[-1] if str(cause).strip() else type(cause).__name__
            raise CheckpointError(f"copying it to {dst} on {target.name} failed: {text[:300]}") from None
        log.info("checkpoint shard %s fetched from %s to %s:%s (sha256 %s)", src, src_host, target.name, dst, sha256[:12])
        return "fetched"

    def prune_checkpoints(self, host: str | None, root: str, keep: list[int], newest: int) -> None:
        """Under Ray: a task pinned to `host` deletes them there (not waited for; a host that is
        gone keeps nothing anyway)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node = self.nodes.get(host)
        if host in LOCAL_HOSTS or (node is not None and self.local is not None and node.node_id == self.local.node_id):
            super().prune_checkpoints(host, root, keep, newest)
            return
        if node is None:
            return
        ray = import_ray()
        task = ray.remote(ray_actor.prune_steps).options(num_cpus=0, max_retries=0, scheduling_strategy=(
            NodeAffinitySchedulingStrategy(node_id=node.node_id, soft=False)))
        self.pruning = [r for r in getattr(self, "pruning", []) if not ray.wait([r], timeout=0)[0]]
        self.pruning.append(task.remote(root, list(keep), newest))

    def close(self) -> None:
        for h in self.handles:
            if h.code is None:
                h.release()
        if getattr(self, "pruning", None):  # the last commit's pruning, before the driver leaves
            import_ray().wait(self.pruning, num_returns=len(self.pruning), timeout=10)
        self.handles = []
        self.cluster.close()
