"""Two "hosts" with distinct addresses: a Ray cluster of host-a (127.0.0.1) and host-b (127.0.0.2),
run inside a network namespace that the test makes, so every packet stays inside it.

    unshare -n sh -c 'ip link set lo up && exec python -m tests.ray.two_hosts SCENARIO.json'

SCENARIO.json: {"graph", "overrides", "run_dir", "out", "timeout_s", "processes", and the optional
parts `run` lists: "host_b_run", "probe", "scale", "keep_checkpoint", "kill", "kill_controller_at",
"resume_overrides", "remove_at_step" | "remove_at_checkpoint", "remove_folder"}. The driver starts
the cluster, runs `flowrl run` on it, records where each node process runs and what its sockets
listen on and talk to, does the scenario's faults in order, waits for the run, and writes what it
saw to "out" as JSON; the tests assert on that (tests/ray/test_two_hosts.py, test_no_shared_fs.py,
test_scale_two_hosts.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HOSTS = {"host-a": "127.0.0.1", "host-b": "127.0.0.2"}


def sockets_of(pids: dict[str, int]) -> dict[str, dict]:
    """name -> {"listen": [ip:port], "peers": [[local, remote]]} of TCP sockets of each process."""
    import psutil

    out = {}
    for name, pid in pids.items():
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.Error:
            continue
        out[name] = {"listen": sorted(f"{c.laddr.ip}:{c.laddr.port}" for c in conns if c.status == psutil.CONN_LISTEN),
                     "peers": sorted([f"{c.laddr.ip}:{c.laddr.port}", f"{c.raddr.ip}:{c.raddr.port}"]
                                     for c in conns if c.status == psutil.CONN_ESTABLISHED and c.raddr)}
    return out


def spec_facts(path: Path) -> dict:
    """What a process was told about its links (its secret key left out)."""
    spec = json.loads(path.read_text())
    return {k: spec[k] for k in ("host", "host_address", "inputs", "input_clients", "control", "curve_public",
                                 "rank_addresses", "rank_keys", "rank_clients")} | {
        "control_key": bool(spec["control_key"]), "outputs": {o["edge"]: o["addresses"] for o in spec["outputs"]},
        "master": [spec["env"].get("MASTER_ADDR"), spec["env"].get("MASTER_PORT")]}


def probes(run_dir: Path, names, sockets: dict) -> dict:
    """A stranger with made-up CURVE keys against every listener of each process that has a tcp
    input, and against the tcp control channel; then the same with a producer's own keys (the
    positive control): "refused" / "succeeded" (tests/curve_probe.py)."""
    from tests.curve_probe import handshake, speaks_zmtp

    raw = {n: json.loads((run_dir / "procs" / f"{n}.json").read_text()) for n in names}
    out = {}
    for name, spec in raw.items():
        if not any(a.startswith("tcp://") for a in spec["inputs"].values()):
            continue
        producer = next(s for s in raw.values() if s["curve_public"] in sum(spec["input_clients"].values(), []))
        for listen in sockets[name]["listen"]:
            address = f"tcp://{listen}"
            if address in spec["rank_addresses"] or not speaks_zmtp(address):
                continue  # its shard channel (probed below, with a peer rank's keys); gloo's sockets, a store
            stranger = handshake(address, spec["curve_public"], timeout_s=2.0)
            mine = handshake(address, spec["curve_public"], (producer["curve_public"], producer["curve_secret"]),
                             send=None, timeout_s=2.0)
            out[f"{name} {address} stranger"], out[f"{name} {address} producer"] = stranger, mine
    for name, spec in raw.items():  # a rank's tcp shard channel admits only its data-parallel peers
        mine = spec["rank_addresses"][spec["rank"]] if spec["rank_addresses"] else ""
        if mine.startswith("tcp://"):
            peer = next(s for s in raw.values() if s["curve_public"] in spec["rank_clients"])
            out[f"{name} rank {mine} stranger"] = handshake(mine, spec["curve_public"])
            out[f"{name} rank {mine} peer"] = handshake(mine, spec["curve_public"],
                                                        (peer["curve_public"], peer["curve_secret"]), send=None)
    remote = next((s for s in raw.values() if s["control"].startswith("tcp://")), None)
    if remote is not None:
        out[f"control {remote['control']} stranger"] = handshake(remote["control"], remote["control_key"])
        out[f"control {remote['control']} node"] = handshake(remote["control"], remote["control_key"],
                                                             (remote["curve_public"], remote["curve_secret"]), send=None)
    return out


def shut_down(proc, cluster, temp_dir: str) -> None:
    """The end of a scenario, whatever happened: the run's process group, Ray, the cluster, its folder."""
    import ray

    from flowrl.testing.harness import kill_group

    if proc is not None and proc.poll() is None:
        kill_group(proc.pid)
        proc.wait()
    ray.shutdown()
    cluster.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


def scale_steps(sc: dict, facts: dict, run_dir: Path, steps, raylets: dict, ours: set) -> None:
    """"scale": [[STEP, NODE, N], ...]: `flowrl.scale(RUN_DIR, NODE, N)` (what `flowrl scale RUN_DIR
    NODE=N` sends) once the run is at STEP. After a
    scale-up: where the new replica runs (once it is wired and took its first batch), its spec, its
    sockets, and CURVE probes (a stranger, its own keys) against the control and its consumers' and
    its own tcp inputs; after a scale-down: the process is gone and its keys are refused."""
    import psutil

    import flowrl
    from flowrl.errors import FlowrlError
    from tests.curve_probe import handshake
    from tests.ray.test_launcher import host_of, node_processes, wait_for, wired

    facts["scale"] = []
    added: dict[str, dict] = {}
    for at, node, n in sc["scale"]:
        wait_for(lambda: steps() >= at, 240, f"step {at}")
        before = node_processes(run_dir)
        try:  # what `flowrl scale RUN_DIR NODE=N` does, without a fresh interpreter's start-up on a busy machine
            row = {"asked_at": steps(), "rc": 0, "out": flowrl.scale(run_dir, node, n)}
        except FlowrlError as e:  # ScaleError: refused
            row = {"asked_at": steps(), "rc": 1, "out": str(e)}
        row.update(at=steps(), node=node, replicas=n)
        facts["scale"].append(row)
        if row["rc"] != 0:
            return
        mine = sorted(k for k in before if k.startswith(f"{node}."))
        if n > len(mine):  # added: the new replicas start, wire and take work
            new = [f"{node}.{r}.0" for r in range(len(mine), n)]
            logs = [run_dir / "logs" / f"{name}.log" for name in new]
            pids = wait_for(lambda: (p := node_processes(run_dir)) and all(x in p for x in new) and wired(run_dir, new)
                            and p, 240, f"{', '.join(new)} to start and wire")
            ours |= {pids[x] for x in new} | {psutil.Process(pids[x]).ppid() for x in new}
            row["hosts"] = {x: host_of(pids[x], raylets) for x in pids}
            row["sockets"] = sockets_of(pids)
            row["specs"] = {x: spec_facts(run_dir / "procs" / f"{x}.json") for x in pids}
            raw = {x: json.loads((run_dir / "procs" / f"{x}.json").read_text()) for x in pids}
            added.update({x: raw[x] for x in new})
            row["probes"] = key_probes(raw, new, row["sockets"], handshake)
            later = [step for step, *_ in sc["scale"] if step > at] or [float("inf")]
            # until the next change at most: whether it is sent work is the producer's choice among
            # replicas with credit
            wait_for(lambda: all("first batch" in f.read_text(errors="replace") for f in logs) or steps() >= later[0],
                     240, "a batch or the next step to scale at")
            row["first_batch"] = all("first batch" in f.read_text(errors="replace") for f in logs)
        else:  # removed: gone, and their keys refused by the control and by their consumers
            gone = [f"{node}.{r}.0" for r in range(n, len(mine))]
            after = wait_for(lambda: (p := node_processes(run_dir)) and not any(x in p for x in gone) and p, 120,
                             f"{', '.join(gone)} to stop")
            raw = {x: json.loads((run_dir / "procs" / f"{x}.json").read_text()) for x in after}
            row["probes"] = revoked_probes(raw, {x: added[x] for x in gone if x in added}, handshake)


def key_probes(raw: dict, new: list[str], sockets: dict, handshake) -> dict:
    """A stranger and the new process's own keys against the control; its keys against the tcp inputs
    it sends into (its spec's outputs); a stranger and its producer's keys against its own tcp input
    (the listener its producer is connected to)."""
    out = {}
    for name in new:
        spec = raw[name]
        me = (spec["curve_public"], spec["curve_secret"])
        if spec["control"].startswith("tcp://"):
            out["control after scale stranger"] = handshake(spec["control"], spec["control_key"], timeout_s=2)
            out[f"control {name}"] = handshake(spec["control"], spec["control_key"], me, send=None, timeout_s=2)
        for edge, addresses in ((o["edge"], o["addresses"]) for o in spec["outputs"]):
            consumer = next(x for x in raw if x.startswith(edge.split("->")[1].split(".")[0].strip() + "."))
            for address in (a for a in addresses if a.startswith("tcp://")):
                out[f"{consumer} {address} {name}"] = handshake(address, raw[consumer]["curve_public"], me, send=None,
                                                                timeout_s=2)
        for producer, s in raw.items():
            if s["curve_public"] not in sum(spec["input_clients"].values(), []):
                continue
            mine = set(sockets.get(name, {}).get("listen", []))
            for listen in sorted({remote for _, remote in sockets.get(producer, {}).get("peers", [])} & mine):
                address = f"tcp://{listen}"
                out[f"{name} {address} stranger"] = handshake(address, spec["curve_public"], timeout_s=2)
                out[f"{name} {address} producer"] = handshake(address, spec["curve_public"], (
                    s["curve_public"], s["curve_secret"]), send=None, timeout_s=2)
    return out


def revoked_probes(raw: dict, gone: dict, handshake) -> dict:
    """The keys of removed processes against the control and against the tcp inputs they fed."""
    out = {}
    control = next((s for s in raw.values() if s["control"].startswith("tcp://")), None)
    for name, spec in gone.items():
        me = (spec["curve_public"], spec["curve_secret"])
        if control is not None:
            out[f"control {name} removed"] = handshake(control["control"], control["control_key"], me, send=None,
                                                       timeout_s=2)
        for edge, addresses in ((o["edge"], o["addresses"]) for o in spec["outputs"]):
            consumer = next(x for x in raw if x.startswith(edge.split("->")[1].split(".")[0].strip() + "."))
            for address in (a for a in addresses if a.startswith("tcp://")):
                out[f"{consumer} {address} {name} removed"] = handshake(address, raw[consumer]["curve_public"], me,
                                                                        send=None, timeout_s=2)
    return out


def scale_results(facts: dict, run_dir: Path, ledger: list[dict]) -> None:
    """After a run with "scale": the plan as it ended, the ledger's `plan` and `scaled` events, and
    the tickets each process handled (the trace's spans of each node process, by batch id)."""
    from flowrl.metrics.trace import load_trace, track_names

    facts["plan_end"] = json.loads((run_dir / "plan.json").read_text())
    facts["plan_events"] = [r for r in ledger if r["event"] == "plan"]
    facts["scaled"] = [r for r in ledger if r["event"] == "scaled"]
    events = load_trace(run_dir / "trace.json") if (run_dir / "trace.json").exists() else []
    names = track_names(events)
    handled: dict[str, set] = {}
    for e in events:
        batch = (e.get("args") or {}).get("batch_id")
        if batch and e.get("pid") in names:
            handled.setdefault(names[e["pid"]].split(" ")[0], set()).add(batch)
    facts["handled"] = {k: sorted(v) for k, v in handled.items()}


def main(path: str) -> int:
    sc = json.loads(Path(path).read_text())
    facts: dict = {}
    try:
        run(sc, facts)
    except Exception:  # noqa: BLE001 - the test shows it
        facts["driver_error"] = traceback.format_exc()
    Path(sc["out"]).write_text(json.dumps(facts, indent=1, default=str))
    return 0


class Folders:
    """RUN_DIR on host-a and, with `launcher.host_dirs`, host-b's own run folder: a process's log
    is in the folder of the host it runs on."""

    def __init__(self, run_dir: Path, host_b_run: str | None):
        self.run_dir = run_dir
        self.all = [run_dir, *([Path(host_b_run)] if host_b_run else [])]

    def logs(self, name: str) -> dict[str, str]:
        """path -> text of the process's log in each folder (two once it moved between hosts)."""
        paths = (folder / "logs" / f"{name}.log" for folder in self.all)
        return {str(path): path.read_text(errors="replace") for path in paths if path.exists()}

    def log(self, name: str) -> str:
        """The process's log in the folder of the host it runs on (the newest one, once it moved)."""
        logs = self.logs(name)
        return max(logs.items(), key=lambda item: os.stat(item[0]).st_mtime)[1] if logs else ""

    def sizes(self, names) -> dict[str, int]:
        return {path: len(text) for name in names for path, text in self.logs(name).items()}

    def wired(self, names, since: dict[str, int] | None = None) -> bool:
        """Each process's log says it wired (after the first `since[path]` characters of it, when given)."""
        return all(any("wired" in text[(since or {}).get(path, 0):] for path, text in self.logs(n).items())
                   for n in names)

    def wired_again(self, name: str) -> bool:
        """The process's log says it wired after a restart (its last READY is of incarnation 1 or later)."""
        last = self.log(name).rsplit("INFO flowrl.worker: ready ", 1)
        return len(last) == 2 and "(incarnation 0)" not in last[1].split("\n", 1)[0] and "wired" in last[1]

    def listing(self) -> dict[str, dict]:
        return {"run_dir" if folder == self.run_dir else "host_b": listing(folder) for folder in self.all}


def run(sc: dict, facts: dict) -> None:
    """The scenario, in this order, each part optional: start and wire; `flowrl scale` ("scale"); a
    copy of the checkpoint committed at step >= "keep_checkpoint" (each shard, from the folder the
    record names: `kept/`); sockets, specs and CURVE probes ("probe", default on); kill -9 of
    a node process ("kill": [NAME, STEP]); kill -9 of the controller once a checkpoint at step >=
    "kill_controller_at" is committed, then `flowrl run --resume` ("resume_overrides"); the loss of
    host-b at step "remove_at_step", or once a checkpoint at step >= "remove_at_checkpoint" is
    committed, with its folder deleted ("remove_folder"); then the end of the run."""
    import psutil
    import ray

    from flowrl.ray_cluster import loopback_cluster, loopback_node_args
    from flowrl.testing import audit_ledger, read_jsonl
    from flowrl.testing.harness import flowrl_command
    from tests.ray.conftest import alive
    from tests.ray.test_launcher import assert_cluster_released_everything, host_of, node_processes, wait_for

    temp_dir = tempfile.mkdtemp(prefix="frl-ray-")
    cluster = loopback_cluster(num_cpus=2, node_name="host-a", temp_dir=temp_dir, no_monitor=True)
    proc = None
    ours: set[int] = set()
    try:
        node_b = cluster.add_node(**loopback_node_args(num_cpus=2, node_name="host-b", temp_dir=temp_dir,
                                                       node_ip_address=HOSTS["host-b"]))
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        facts["ray_nodes"] = {n["NodeName"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
        raylets = {"host-a": cluster.head_node.all_processes["raylet"][0].process.pid,
                   "host-b": node_b.all_processes["raylet"][0].process.pid}
        run_dir, address = Path(sc["run_dir"]), f"launcher.address={cluster.address}"
        folders = Folders(run_dir, sc.get("host_b_run"))
        latest = run_dir / "checkpoints" / "latest.json"
        cmd = flowrl_command(sc["graph"], run_dir, overrides=sc["overrides"] + [address],
                             extra=["--inventory", f"ray:{cluster.address}"])
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                cwd=sc.get("cwd"))
        metrics = run_dir / "metrics.jsonl"

        def steps() -> int:
            return len(read_jsonl(metrics)) if metrics.exists() else 0

        def committed() -> int:
            return json.loads(latest.read_text())["step"] if latest.exists() else -1

        def mine(pids: dict[str, int]) -> None:
            ours.update(pids.values(), (psutil.Process(p).ppid() for p in pids.values() if psutil.pid_exists(p)))

        def started():
            if proc.poll() is not None:  # the run ended before it wired: its output says why (the test shows it)
                raise AssertionError(f"the run exited with code {proc.returncode} before every node process wired")
            return (p := node_processes(run_dir)) and len(p) == sc["processes"] and folders.wired(p) and p

        pids = wait_for(started, 180, "every node process to start and wire")
        facts["started_s"] = time.monotonic() - t0
        facts["hosts"] = {name: host_of(pid, raylets) for name, pid in pids.items()}
        mine(pids)
        wait_for(lambda: steps() >= 2, 120, "two steps")
        if sc.get("scale"):  # before the probes below: they take seconds, and the run goes on meanwhile
            try:
                scale_steps(sc, facts, run_dir, steps, raylets, ours)
            except AssertionError:  # a wait that timed out: the run's own output says why (the test shows both)
                facts["scale_error"] = traceback.format_exc()
        if sc.get("keep_checkpoint"):
            at = sc["keep_checkpoint"]
            wait_for(lambda: committed() >= at, 240, f"a checkpoint at step >= {at}")
            facts["kept"] = keep(latest, Path(sc["out"]).parent / "kept")
        facts["specs"] = {name: spec_facts(run_dir / "procs" / f"{name}.json") for name in pids}
        if "scale_error" not in facts and sc.get("probe", True):  # (else the run may be over: its output shows why)
            facts["sockets"] = sockets_of(pids)
            facts["controller_sockets"] = sockets_of({"controller": proc.pid})
            t_probe = time.monotonic()
            facts["probes"] = probes(run_dir, pids, facts["sockets"])
            facts["probe_s"] = time.monotonic() - t_probe
        if sc.get("kill"):
            name, at = sc["kill"]
            wait_for(lambda: steps() >= at, 240, f"step {at}")
            facts["killed"] = [name, pids[name], steps()]
            os.kill(pids[name], signal.SIGKILL)
            # back (a new process, wired) before anything else happens: a later fault is a second one
            pids = wait_for(lambda: (p := node_processes(run_dir)).get(name) not in (None, pids[name])
                            and len(p) == sc["processes"] and folders.wired_again(name) and p, 180, f"{name} to be back")
            mine(pids)
        if sc.get("kill_controller_at"):
            at = sc["kill_controller_at"]
            wait_for(lambda: committed() >= at or proc.poll() is not None, 240, f"a checkpoint at step >= {at}")
            facts["checkpoint_before"] = committed()
            since = folders.sizes(pids)
            proc = kill_and_resume(sc, facts, proc, folders, address, cluster.address)
            pids = wait_for(lambda: (p := node_processes(run_dir)) and len(p) == sc["processes"]
                            and folders.wired(p, since) and p, 180, "every node process to start and wire again")
            facts["hosts_resumed"] = {name: host_of(pid, raylets) for name, pid in pids.items()}
            mine(pids)
        if sc.get("remove_at_step") or sc.get("remove_at_checkpoint"):
            if sc.get("remove_at_step"):
                wait_for(lambda: steps() >= sc["remove_at_step"], 240, f"step {sc['remove_at_step']}")
            else:
                at = sc["remove_at_checkpoint"]
                wait_for(lambda: committed() >= at or proc.poll() is not None, 240, f"a checkpoint at step >= {at}")
            facts["removed_at"], facts["before_removal"] = steps(), folders.listing()
            on_b = {n for n, p in pids.items() if host_of(p, raylets) == "host-b"}
            cluster.remove_node(node_b)  # the whole host goes: raylet, workers, actors, node processes
            if sc.get("remove_folder"):
                wait_for(lambda: not any(psutil.pid_exists(pids[n]) for n in on_b), 60, "host-b's processes to die")
                shutil.rmtree(sc["host_b_run"], ignore_errors=True)
            after = wait_for(lambda: (p := node_processes(run_dir)) and len(p) == sc["processes"]
                             and all(p.get(n) != pids[n] for n in on_b) and p, 180,
                             "the lost host's processes to start again elsewhere")
            facts["hosts_after"] = {name: host_of(pid, raylets) for name, pid in after.items()}
            mine(after)
        record_output(facts, proc, sc, sc["timeout_s"])
        facts["wall_s"] = time.monotonic() - t0
        ledger = read_jsonl(run_dir / "ledger.jsonl")
        audit = audit_ledger(ledger)
        facts["audit"] = {"exactly_once": audit.exactly_once, "issued": len(audit.issued),
                          "lost": audit.lost[:5], "duplicated": audit.duplicated[:5]}
        facts["events"] = {e: [r for r in ledger if r["event"] == e]
                           for e in ("node_down", "shard", "resumed", "recovery", "replanned", "plan")}
        facts["replanned"], facts["recoveries"] = facts["events"]["replanned"], facts["events"]["recovery"]
        facts["node_down"] = [r["node"] for r in facts["events"]["node_down"]]
        facts["rewards"] = [r["reward_mean"] for r in read_jsonl(metrics) if "reward_mean" in r]
        facts["versions"] = [r.get("policy_version") for r in read_jsonl(metrics)]
        facts["folders"] = folders.listing()
        if latest.exists():
            record = json.loads(latest.read_text())
            facts["latest"], facts["digests"] = record, {p: digest(Path(s["folder"]) / "checkpoints" / s["file"])
                                                         for p, s in record.get("shards", {}).items()}
        if sc.get("scale"):
            scale_results(facts, run_dir, ledger)
        facts["status"] = json.loads((run_dir / "status.json").read_text()) if (run_dir / "status.json").exists() else None
        wait_for(lambda: not alive(ours), 20, "every node process and actor to be gone")
        facts["left_alive"] = alive(ours) + list(node_processes(run_dir).values())
        try:
            assert_cluster_released_everything()
            facts["cluster_released"] = True
        except AssertionError as e:
            facts["cluster_released"] = str(e)
        facts["sockdirs_left"] = [str(p) for p in Path(tempfile.gettempdir()).glob("flowrl-*")
                                  if (p / "pid").exists() and (p / "pid").read_text().strip() == str(proc.pid)]
    except BaseException:
        if proc is not None and "stderr" not in facts:  # a wait ran out: what the run and its nodes said
            facts["ray_state"] = ray_state()  # before the run ends: its actors die with it
            record_output(facts, proc, sc, 5)  # one that exited returns at once
            facts["logs_tail"] = logs_tail(Folders(Path(sc["run_dir"]), sc.get("host_b_run")))
        raise
    finally:
        shut_down(proc, cluster, temp_dir)


def record_output(facts: dict, proc, sc: dict, timeout_s: float) -> None:
    """The run's exit code and output into `facts`, once it ends; after `timeout_s` its process
    group is killed (a dump of every process first, with "dump")."""
    from flowrl.testing.harness import kill_group

    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGUSR1) if sc.get("dump") else None
        kill_group(proc.pid)
        out, err = proc.communicate()
        err += f"\n[two_hosts] killed after {timeout_s} s"
    facts["rc"], facts["stdout"], facts["stderr"] = proc.returncode, out[-4000:], err[-6000:]


def ray_state() -> str:
    """What Ray says of the cluster when a wait ran out: each node process's actor (its state, node,
    PID, start and end, why it died) and each node's free resources. Tells an actor that never got
    its resources (PENDING_CREATION, no PID) from one that started and then hung."""
    import ray
    from ray._private.state import state

    try:
        names = {n["NodeID"]: n.get("NodeName") or n["NodeManagerAddress"] for n in ray.nodes()}
        lines = []
        for a in sorted(state.actor_table(None).values(), key=lambda a: a["StartTime"] or float("inf")):
            if a["ActorClassName"].endswith("FlowrlNodeProcess"):
                said = re.search(r'error_message: "(.*?)"', str(a["DeathCause"])) if a["State"] == "DEAD" else None
                cause = said.group(1)[:200] if said else ""
                lines.append(f"{a['State']:<17} {names.get(a['Address']['NodeID'], '?'):<7} pid {a['Pid']:<7} "
                             f"start {a['StartTime']} end {a['EndTime']} {cause}")
        free = {names.get(k, k): v for k, v in state.available_resources_per_node().items()}
        return "\n".join(["--- Ray actors of node processes (oldest first)", *lines, f"--- free: {free}"])
    except Exception as e:  # noqa: BLE001 - an aid to reading a failure; never the failure itself
        return f"--- Ray state unavailable: {type(e).__name__}: {e}"


def logs_tail(folders: Folders, chars: int = 1500) -> str:
    """The end of every node log in the run's folders, for a scenario that stopped short."""
    return "\n".join(f"--- {path}\n{path.read_text(errors='replace')[-chars:]}"
                     for folder in folders.all for path in sorted((folder / "logs").glob("*.log")))


def digest(path: Path) -> str | None:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def keep(latest: Path, into: Path) -> dict:
    """A copy of each shard of the checkpoint latest.json names now (read from the folder the record
    names, on whichever host): {"step", "shards": {proc: {"host", "file", "copy"}}}."""
    record = json.loads(latest.read_text())
    into.mkdir(parents=True, exist_ok=True)
    shards = {}
    for proc_id, shard in record["shards"].items():
        copy = into / shard["file"].replace("/", "_")
        shutil.copyfile(Path(shard["folder"]) / "checkpoints" / shard["file"], copy)
        shards[proc_id] = {"host": shard["host"], "file": shard["file"], "copy": str(copy)}
    return {"step": record["step"], "shards": shards}


def listing(folder: Path) -> dict[str, list[str]]:
    """Logs, pid files and checkpoint shards under a run folder (relative names)."""
    return {kind: sorted(str(p.relative_to(folder)) for p in folder.glob(pattern))
            for kind, pattern in (("logs", "logs/*.log"), ("pids", "procs/*.pid"), ("shards", "checkpoints/step*/*.pt"))}


def kill_and_resume(sc: dict, facts: dict, proc, folders: Folders, address: str, cluster_address: str):
    """kill -9 of the controller (Ray ends its actors, their children die with them), every node
    process gone, then `flowrl run --resume RUN_DIR [sc["resume_overrides"]]`."""
    from tests.ray.test_launcher import node_processes, wait_for

    os.kill(proc.pid, signal.SIGKILL)
    _, err = proc.communicate()
    facts["first_rc"], facts["first_stderr"] = proc.returncode, err[-3000:]
    wait_for(lambda: not node_processes(folders.run_dir), 60, "every node process to go with the controller")
    facts["before_resume"] = folders.listing()
    resume = [sys.executable, "-m", "flowrl", "run", "--resume", str(folders.run_dir), address,
              *sc.get("resume_overrides", []), "--quiet", "--inventory", f"ray:{cluster_address}"]
    return subprocess.Popen(resume, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            cwd=sc.get("cwd"))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
