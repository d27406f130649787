"""Two "hosts" with distinct addresses: a Ray cluster of host-a (127.0.0.1) and host-b (127.0.0.2),
run inside a network namespace that the test makes, so every packet stays inside it.

    unshare -n sh -c 'ip link set lo up && exec python -m tests.ray.two_hosts SCENARIO.json'

SCENARIO.json: {"graph", "overrides", "run_dir", "out", "timeout_s", "kill": [NAME, STEP] | null,
"remove_at_step": STEP | null}; or {"nofs": true, ...} (run_nofs). The driver starts the cluster, runs `flowrl run` on it, records
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


def wired_again(run_dir: Path, name: str) -> bool:
    """The process's log says it wired after a restart (its last READY is of incarnation 1 or later)."""
    log = run_dir / "logs" / f"{name}.log"
    last = (log.read_text(errors="replace") if log.exists() else "").rsplit("INFO flowrl.worker: ready ", 1)
    return len(last) == 2 and "(incarnation 0)" not in last[1].split("\n", 1)[0] and "wired" in last[1]


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
        if proc is not None and proc.poll() is None:
            kill_group(proc.pid)
            proc.wait()
        ray.shutdown()
        cluster.shutdown()
        import shutil

        shutil.rmtree(temp_dir, ignore_errors=True)


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
        if proc is not None and proc.poll() is None:
            kill_group(proc.pid)
            proc.wait()
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


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
