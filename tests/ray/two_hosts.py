"""Two "hosts" with distinct addresses: a Ray cluster of host-a (127.0.0.1) and host-b (127.0.0.2),
run inside a network namespace that the test makes, so every packet stays inside it.

    unshare -n sh -c 'ip link set lo up && exec python -m tests.ray.two_hosts SCENARIO.json'

SCENARIO.json: {"graph", "overrides", "run_dir", "out", "timeout_s", "kill": [NAME, STEP] | null,
"remove_at_step": STEP | null, "scale": [[STEP, NODE, N], ...] (optional: `flowrl scale` at those
steps, `scale_steps`)}; or {"nofs": true, ...} (run_nofs). The driver starts the cluster, runs `flowrl run` on it, records
where each node process runs and what its sockets listen on and talk to, kills a node process of
host-b (kill -9) and/or removes host-b from the cluster at the given steps, waits for the run,
and writes what it saw to "out" as JSON; the test asserts on that (tests/ray/test_two_hosts.py).
"""

from __future__ import annotations

import json
import os
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
    from tests.curve_probe import handshake

    raw = {n: json.loads((run_dir / "procs" / f"{n}.json").read_text()) for n in names}
    out = {}
    for name, spec in raw.items():
        if not any(a.startswith("tcp://") for a in spec["inputs"].values()):
            continue
        producer = next(s for s in raw.values() if s["curve_public"] in sum(spec["input_clients"].values(), []))
        for listen in sockets[name]["listen"]:
            address = f"tcp://{listen}"
            if address in spec["rank_addresses"]:
                continue  # its shard channel: probed below, with a peer rank's keys
            stranger = handshake(address, spec["curve_public"], timeout_s=2.0)
            mine = handshake(address, spec["curve_public"], (producer["curve_public"], producer["curve_secret"]),
                             send=None, timeout_s=2.0)
            if stranger == mine == "timeout":
                continue  # no ZeroMQ there: gloo's sockets, a group's store
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
    import shutil

    import ray

    from flowrl.testing.harness import kill_group

    if proc is not None and proc.poll() is None:
        kill_group(proc.pid)
        proc.wait()
    ray.shutdown()
    cluster.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


def wired_again(run_dir: Path, name: str) -> bool:
    """The process's log says it wired after a restart (its last READY is of incarnation 1 or later)."""
    log = run_dir / "logs" / f"{name}.log"
    last = (log.read_text(errors="replace") if log.exists() else "").rsplit("INFO flowrl.worker: ready ", 1)
    return len(last) == 2 and "(incarnation 0)" not in last[1].split("\n", 1)[0] and "wired" in last[1]


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
        (run_nofs if sc.get("nofs") else run)(sc, facts)
    except Exception:  # noqa: BLE001 - the test shows it
        facts["driver_error"] = traceback.format_exc()
    Path(sc["out"]).write_text(json.dumps(facts, indent=1, default=str))
    return 0


def run(sc: dict, facts: dict) -> None:
    import psutil
    import ray

    from flowrl.ray_cluster import loopback_cluster, loopback_node_args
    from flowrl.testing import audit_ledger, read_jsonl
    from flowrl.testing.harness import flowrl_command, kill_group
    from tests.ray.conftest import alive
    from tests.ray.test_launcher import (
        assert_cluster_released_everything,
        host_of,
        node_processes,
        wait_for,
        wired,
    )

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
        run_dir = Path(sc["run_dir"])
        cmd = flowrl_command(sc["graph"], run_dir, overrides=sc["overrides"] + [f"launcher.address={cluster.address}"],
                             extra=["--inventory", f"ray:{cluster.address}"])
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                cwd=sc.get("cwd"))
        metrics = run_dir / "metrics.jsonl"

        def steps() -> int:
            return len(read_jsonl(metrics)) if metrics.exists() else 0

        pids = wait_for(lambda: (p := node_processes(run_dir)) and len(p) == sc["processes"] and wired(run_dir, p)
                        and p, 180, "every node process to start and wire")
        facts["started_s"] = time.monotonic() - t0
        facts["hosts"] = {name: host_of(pid, raylets) for name, pid in pids.items()}
        ours |= set(pids.values()) | {psutil.Process(p).ppid() for p in pids.values()}
        wait_for(lambda: steps() >= 2, 120, "two steps")
        if sc.get("scale"):  # before the probes below: they take seconds, and the run goes on meanwhile
            try:
                scale_steps(sc, facts, run_dir, steps, raylets, ours)
            except AssertionError:  # a wait that timed out: the run's own output says why (the test shows both)
                facts["scale_error"] = traceback.format_exc()
        if "scale_error" not in facts:  # (else the run may be over: its output shows why)
            facts["sockets"] = sockets_of(pids)
            facts["controller_sockets"] = sockets_of({"controller": proc.pid})
            facts["specs"] = {name: spec_facts(run_dir / "procs" / f"{name}.json") for name in pids}
            facts["probes"] = probes(run_dir, pids, facts["sockets"])
        if sc.get("kill"):
            name, at = sc["kill"]
            wait_for(lambda: steps() >= at, 240, f"step {at}")
            facts["killed"] = [name, pids[name], steps()]
            os.kill(pids[name], signal.SIGKILL)
            # back (a new process, wired) before anything else happens: a later fault is a second one
            wait_for(lambda: (p := node_processes(run_dir)).get(name) not in (None, pids[name])
                     and len(p) == sc["processes"] and wired_again(run_dir, name), 180, f"{name} to be back")
        if sc.get("remove_at_step"):
            at = sc["remove_at_step"]
            wait_for(lambda: steps() >= at, 240, f"step {at}")
            facts["removed_at"] = steps()
            cluster.remove_node(node_b)  # the whole host goes: raylet, workers, actors, node processes
            after = wait_for(lambda: (p := node_processes(run_dir)) and len(p) == sc["processes"]
                             and all(p.get(n) != pids.get(n) for n in facts["hosts"] if facts["hosts"][n] == "host-b")
                             and p, 180, "the lost host's processes to start again elsewhere")
            facts["hosts_after"] = {name: host_of(pid, raylets) for name, pid in after.items()}
            ours |= set(after.values()) | {psutil.Process(p).ppid() for p in after.values()}
        try:
            out, err = proc.communicate(timeout=sc["timeout_s"])
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGUSR1) if sc.get("dump") else None
            kill_group(proc.pid)
            out, err = proc.communicate()
            err += f"\n[two_hosts] killed after {sc['timeout_s']} s"
        facts["wall_s"] = time.monotonic() - t0
        facts["rc"], facts["stdout"], facts["stderr"] = proc.returncode, out[-4000:], err[-6000:]
        ledger = read_jsonl(run_dir / "ledger.jsonl")
        audit = audit_ledger(ledger)
        facts["audit"] = {"exactly_once": audit.exactly_once, "issued": len(audit.issued),
                          "lost": audit.lost[:5], "duplicated": audit.duplicated[:5]}
        facts["replanned"] = [r for r in ledger if r["event"] == "replanned"]
        facts["node_down"] = [r["node"] for r in ledger if r["event"] == "node_down"]
        facts["rewards"] = [r["reward_mean"] for r in read_jsonl(metrics) if "reward_mean" in r]
        facts["versions"] = [r.get("policy_version") for r in read_jsonl(metrics)]
        facts["recoveries"] = [r for r in ledger if r["event"] == "recovery"]
        if sc.get("scale"):
            scale_results(facts, run_dir, ledger)
        facts["status"] = json.loads((run_dir / "status.json").read_text()) if (run_dir / "status.json").exists() else None
        wait_for(lambda: not alive(ours), 20, "every node process and actor to be gone")
        facts["left_alive"] = alive(ours)
        try:
            assert_cluster_released_everything()
            facts["cluster_released"] = True
        except AssertionError as e:
            facts["cluster_released"] = str(e)
        facts["sockdirs_left"] = [str(p) for p in Path(tempfile.gettempdir()).glob("flowrl-*")
                                  if (p / "pid").exists() and (p / "pid").read_text().strip() == str(proc.pid)]
    finally:
        shut_down(proc, cluster, temp_dir)


def listing(folder: Path) -> dict[str, list[str]]:
    """Logs, pid files and checkpoint shards under a run folder (relative names)."""
    return {kind: sorted(str(p.relative_to(folder)) for p in folder.glob(pattern))
            for kind, pattern in (("logs", "logs/*.log"), ("pids", "procs/*.pid"), ("shards", "checkpoints/step*/*.pt"))}


def run_nofs(sc: dict, facts: dict) -> None:
    """Scenario "nofs" (no shared filesystem, tests/ray/test_no_shared_fs.py): `flowrl run` with
    host-b's run folder elsewhere (`launcher.host_dirs`); once a checkpoint at step >=
    sc["kill_controller_at"] is committed, kill -9 of the controller and `--resume` (kill_and_resume);
    or at sc["remove_at_checkpoint"], host-b leaves the cluster and its folder is deleted. Records
    both folders, the commit record, each shard's sha256 as read from the folder the record names,
    and the ledger."""
    import hashlib
    import shutil

    import ray

    from flowrl.ray_cluster import loopback_cluster, loopback_node_args
    from flowrl.testing import audit_ledger, read_jsonl
    from flowrl.testing.harness import flowrl_command, kill_group
    from tests.ray.test_launcher import host_of, node_processes, wait_for

    temp_dir = tempfile.mkdtemp(prefix="frl-ray-")
    cluster = loopback_cluster(num_cpus=2, node_name="host-a", temp_dir=temp_dir, no_monitor=True)
    proc = None
    try:
        node_b = cluster.add_node(**loopback_node_args(num_cpus=2, node_name="host-b", temp_dir=temp_dir,
                                                       node_ip_address=HOSTS["host-b"]))
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        raylets = {"host-a": cluster.head_node.all_processes["raylet"][0].process.pid,
                   "host-b": node_b.all_processes["raylet"][0].process.pid}
        run_dir, address = Path(sc["run_dir"]), f"launcher.address={cluster.address}"
        latest = run_dir / "checkpoints" / "latest.json"
        cmd = flowrl_command(sc["graph"], run_dir, overrides=sc["overrides"] + [address],
                             extra=["--inventory", f"ray:{cluster.address}"])
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                cwd=sc.get("cwd"))
        pids = wait_for(lambda: (p := node_processes(run_dir)) and len(p) == sc["processes"] and p, 180,
                        "every node process to start")
        facts["hosts"] = {name: host_of(pid, raylets) for name, pid in pids.items()}
        at = sc.get("kill_controller_at") or sc["remove_at_checkpoint"]
        wait_for(lambda: latest.exists() and json.loads(latest.read_text())["step"] >= at or proc.poll() is not None,
                 240, f"a checkpoint at step >= {at}")
        facts["checkpoint_before"] = json.loads(latest.read_text())["step"]
        facts["before"] = {"run_dir": listing(run_dir), "host_b": listing(Path(sc["host_b_run"]))}
        if sc.get("remove_at_checkpoint"):  # host-b (and its folder) gone: its processes move, shards from the copies
            import psutil

            cluster.remove_node(node_b)
            gone = [pid for name, pid in pids.items() if facts["hosts"][name] == "host-b"]
            wait_for(lambda: not any(psutil.pid_exists(p) for p in gone), 60, "host-b's processes to die with it")
            shutil.rmtree(sc["host_b_run"], ignore_errors=True)
        else:
            proc = kill_and_resume(sc, facts, proc, run_dir, address, cluster.address)
        try:
            out, err = proc.communicate(timeout=sc["timeout_s"])
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            out, err = proc.communicate()
            err += f"\n[two_hosts] killed after {sc['timeout_s']} s"
        facts["wall_s"] = time.monotonic() - t0
        facts["rc"], facts["stdout"], facts["stderr"] = proc.returncode, out[-4000:], err[-6000:]
        facts["run_dir"], facts["host_b"] = listing(run_dir), listing(Path(sc["host_b_run"]))
        record = json.loads(latest.read_text())
        facts["latest"] = record
        facts["digests"] = {p: hashlib.sha256((Path(s["folder"]) / "checkpoints" / s["file"]).read_bytes()).hexdigest()
                            for p, s in record.get("shards", {}).items()}
        ledger = read_jsonl(run_dir / "ledger.jsonl")
        audit = audit_ledger(ledger)
        facts["audit"] = {"exactly_once": audit.exactly_once, "issued": len(audit.issued),
                          "lost": audit.lost[:5], "duplicated": audit.duplicated[:5]}
        facts["events"] = {e: [r for r in ledger if r["event"] == e]
                           for e in ("node_down", "shard", "resumed", "recovery", "replanned")}
        facts["rewards"] = [r["reward_mean"] for r in read_jsonl(run_dir / "metrics.jsonl") if "reward_mean" in r]
        facts["left_alive"] = list(node_processes(run_dir).values())
    finally:
        shut_down(proc, cluster, temp_dir)


def kill_and_resume(sc: dict, facts: dict, proc, run_dir: Path, address: str, cluster_address: str):
    """kill -9 of the controller (Ray ends its actors, their children die with them), every node
    process gone, then `flowrl run --resume RUN_DIR [sc["resume_overrides"]]`."""
    from tests.ray.test_launcher import node_processes, wait_for

    os.kill(proc.pid, signal.SIGKILL)
    _, err = proc.communicate()
    facts["first_rc"], facts["first_stderr"] = proc.returncode, err[-3000:]
    wait_for(lambda: not node_processes(run_dir), 60, "every node process to go with the controller")
    facts["before_resume"] = {"run_dir": listing(run_dir), "host_b": listing(Path(sc["host_b_run"]))}
    resume = [sys.executable, "-m", "flowrl", "run", "--resume", str(run_dir), address, *sc.get("resume_overrides", []),
              "--quiet", "--inventory", f"ray:{cluster_address}"]
    return subprocess.Popen(resume, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            cwd=sc.get("cwd"))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
