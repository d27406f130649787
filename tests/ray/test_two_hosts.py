"""graphs/ppo.yaml under the Ray launcher on two "hosts" with distinct addresses, host-a at 127.0.0.1
and host-b at 127.0.0.2 (on an interface of its own), inside a network namespace this test makes
(`unshare -n`; every packet stays in it). The actor's 4 ranks span the hosts (0-1 on host-a, 2-3 on
host-b) and host-b keeps its own run folder: no folder is shared. In one run:

- the edges between the hosts, the actor's shard channels across them and host-b's control are
  tcp + CURVE, bound to their host's address (never 0.0.0.0), while within a host they stay ipc;
  a stranger's CURVE key is refused; gloo on host-b binds 127.0.0.2;
- the checkpoint at step 8 holds every rank's model equal to a 1-host, 4-rank run of the same seed;
- kill -9 of rank 2 restarts the actor's group once;
- kill -9 of the controller, then `--resume` from the commit record on host-a: each shard read where
  it is, on both hosts, and the critic (planned on host-a now) fetched from host-b through Ray;
- the loss of host-b and its folder: ranks 2-3 and rollout re-planned onto host-a, the group whole,
  their shards from the `launcher.checkpoint_uri` copies;
- it learns (reward >= 0.9 in its last steps), every ticket consumed exactly once, and leaves no
  process, actor or socket folder behind.

The scenario runs in tests/ray/two_hosts.py (inside the namespace); this file asserts on what it saw.
The other two-host tests: tests/ray/test_no_shared_fs.py (the trainers' host lost with its folder),
tests/ray/test_scale_two_hosts.py (`flowrl scale` across hosts).
Needs the `ray` extra and `unshare` + `ip` (root, or unprivileged user namespaces).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.runtime.protocol.checkpoints import load_state
from flowrl.testing import node_state

ROOT = Path(__file__).resolve().parents[2]
ADDRESS = {"host-a": "127.0.0.1", "host-b": "127.0.0.2"}
STEPS = 80  # the reward passes 0.9 near step 65 (the run replays about 8 steps after its faults)
HOST_B_INTERFACE = "ip link add flhostb type bridge && ip addr add 127.0.0.2/32 dev flhostb && ip link set flhostb up"
# the actor's 4 ranks span the hosts (2 cores each): ranks 0-1 on host-a, 2-3 on host-b
SPANNING = {"prompts": "host-a", "reward": "host-a", "reference": "host-a", "critic": "host-b", "rollout": "host-b"}
ACTOR_HOSTS = {0: "host-a", 1: "host-a", 2: "host-b", 3: "host-b"}


def namespace_prefix() -> list[str]:
    """`unshare -n` (root) or `unshare -rn` (a user namespace), with loopback up; skip without."""
    if not (shutil.which("unshare") and shutil.which("ip")):
        pytest.skip("needs unshare and ip (util-linux, iproute2) to make a network namespace")
    prefix = ["unshare", "-n"] if os.geteuid() == 0 else ["unshare", "-rn"]
    probe = subprocess.run([*prefix, "sh", "-c", "ip link set lo up"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {probe.stderr.strip()[:200]}")
    return prefix


def run_scenario(tmp_path: Path, scenario: dict, timeout_s: float) -> dict:
    scenario = {"cwd": str(ROOT), "run_dir": str(tmp_path / "run"), "out": str(tmp_path / "facts.json"), **scenario}
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps(scenario))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("RAY_ADDRESS", None)
    # host-b's address on an interface of its own (a bridge with nothing on it), as on a second
    # machine: gloo there binds the interface that holds 127.0.0.2, not loopback's 127.0.0.1
    cmd = [*namespace_prefix(), "sh", "-c", f'ip link set lo up && {HOST_B_INTERFACE} && '
           f'exec "{sys.executable}" -m tests.ray.two_hosts "{path}"']
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, env=env)
    assert proc.returncode == 0 and Path(scenario["out"]).exists(), proc.stderr[-3000:]
    facts = json.loads(Path(scenario["out"]).read_text())
    assert "driver_error" not in facts, "\n".join([facts["driver_error"], facts.get("stderr", ""),
                                                    facts.get("ray_state", ""), facts.get("logs_tail", "")])
    return facts


@pytest.mark.slow
@pytest.mark.timeout(720)  # 203 s on a quiet day, 352 s on a slow one
def test_an_actor_spanning_two_hosts_without_a_shared_folder_learns_trains_as_on_one_host_and_survives_every_fault(tmp_path):
    """graphs/ppo.yaml, actor `devices=4` as ranks 0-1 on host-a and 2-3 on host-b, critic and rollout
    on host-b, host-b in its own run folder (`launcher.host_dirs`), shards also copied to
    `launcher.checkpoint_uri`. In one run: the checkpoint at step 8 is kept (each rank's model is
    then compared with a 1-host, 4-rank run of the same seed); kill -9 of rank 2 (on host-b); kill
    -9 of the controller and `--resume` with the critic planned on host-a (its shard fetched from
    host-b through Ray, the actor's read in place on both hosts); then host-b leaves the cluster and
    its folder is deleted (its processes re-planned onto host-a, their shards from the copies). It
    learns, and every ticket is consumed exactly once."""
    from flowrl.testing.harness import run_graph

    host_b, bucket, run_dir = tmp_path / "host-b-disk", tmp_path / "bucket", tmp_path / "run"
    hosts = [f"nodes.{node}.host={host}" for node, host in SPANNING.items()]
    facts = run_scenario(tmp_path, {
        "graph": str(ROOT / "graphs" / "ppo.yaml"), "host_b_run": str(host_b / "run"),
        "overrides": ["launcher.type=ray", f"schedule.steps={STEPS}", "nodes.actor.devices=4", "schedule.checkpoint_every=8",
                      f"launcher.host_dirs.host-b={host_b}", f"launcher.checkpoint_uri={bucket}", *hosts],
        "processes": 9, "timeout_s": 450, "keep_checkpoint": 8, "kill": ["actor.0.2", 10],
        "kill_controller_at": 24, "resume_overrides": ["nodes.critic.host=host-a"],
        "remove_at_step": 40, "remove_folder": True}, timeout_s=560)
    assert facts["ray_nodes"] == ADDRESS
    assert facts["rc"] == 0, facts["stderr"]
    where = {**{f"{n}.0.0": h for n, h in SPANNING.items()}, **{f"actor.0.{r}": h for r, h in ACTOR_HOSTS.items()}}
    # where each process ran, from its plan entry (ranks packed per host, in host order) and the process tree
    assert {name: spec["host"] for name, spec in facts["specs"].items()} == where
    assert facts["hosts"] == where
    assert_links(facts, where)

    # each host keeps its own processes' logs, pid files and shards: host-b's folder, not RUN_DIR
    before = facts["before_resume"]
    on_b = {n for n, h in where.items() if h == "host-b"}
    assert set(before["host_b"]["logs"]) == {f"logs/{n}.log" for n in on_b}
    assert set(before["run_dir"]["logs"]) == {f"logs/{n}.log" for n in set(where) - on_b}
    shards = {h: {Path(s).name.split(".e")[0] for s in before[h]["shards"]} for h in ("run_dir", "host_b")}
    assert shards == {"run_dir": {"actor.0.0", "actor.0.1"}, "host_b": {"actor.0.2", "actor.0.3", "critic.0.0"}}

    # kill -9 of a rank on host-b: its whole group restarts (once). A rank on host-a whose collective
    # broke exits by itself within milliseconds and waits up to PEER_LOSS_GRACE_S (restarts.py) for
    # the killed one's exit to be seen, so the killed rank is usually named first, but not always:
    # Ray may report an exit on host-b later than that
    assert facts["killed"][0] == "actor.0.2"
    first = facts["node_down"][:4]
    assert sorted(first) == [f"actor/0/{r}" for r in range(4)], facts["node_down"]

    # kill -9 of the controller, `--resume` from the commit record on host-a alone: every rank reads
    # its shard where it is (on both hosts), the critic's is fetched from host-b to host-a
    assert facts["first_rc"] == -9 and facts["checkpoint_before"] >= 24
    events = facts["events"]
    assert len(events["resumed"]) == 1 and events["resumed"][0]["step"] >= 24
    assert facts["hosts_resumed"] == {**where, "critic.0.0": "host-a"}
    resumed_at, lost_at = events["resumed"][0]["t"], events["replanned"][0]["t"]
    placed = sorted((r["proc"], r["host"], r["holder"], r["fetched"]) for r in events["shard"]
                    if resumed_at <= r["t"] < lost_at)
    assert placed == [("actor/0/0", "host-a", "host-a", False), ("actor/0/1", "host-a", "host-a", False),
                      ("actor/0/2", "host-b", "host-b", False), ("actor/0/3", "host-b", "host-b", False),
                      ("critic/0/0", "host-a", "host-b", True)], events["shard"]

    # host-b lost, its folder with it: ranks 2-3 and rollout re-planned onto host-a, the group whole;
    # ranks 2-3 start from their checkpoint_uri copies
    assert not (host_b / "run").exists()
    assert [r["moved"] for r in events["replanned"]] == [
        {"actor/0/2": "host-a", "actor/0/3": "host-a", "rollout/0/0": "host-a"}]
    assert set(facts["hosts_after"].values()) == {"host-a"}
    moved = sorted((r["proc"], r["host"], r["holder"], r["fetched"]) for r in events["shard"] if r["t"] >= lost_at)
    assert {("actor/0/2", "host-a", "checkpoint_uri", True), ("actor/0/3", "host-a", "checkpoint_uri", True)} <= set(moved)
    plan_end = {(e["node"], e["rank"]): e["host"] for e in json.loads((run_dir / "plan.json").read_text())["plan"]}
    assert set(plan_end.values()) == {"host-a"}
    assert "replanned host-b lost: actor/0/2 -> host-a" in facts["stdout"]
    record = facts["latest"]
    assert record["step"] == STEPS
    for proc, shard in record["shards"].items():  # the last commit: on host-a, in RUN_DIR, copied to the bucket too
        assert (shard["host"], shard["folder"]) == ("host-a", str(run_dir)), proc
        assert shard["sha256"] == facts["digests"][proc] and len(shard["sha256"]) == 64
    assert sorted(p.name for p in (bucket / "run" / "checkpoints").iterdir())[-2:] == ["step00000072", "step00000080"]

    # exactly once (rollbacks replayed steps), learned, nothing left
    assert facts["audit"] == {"exactly_once": True, "issued": STEPS, "lost": [], "duplicated": []}
    rewards = facts["rewards"]
    assert len(rewards) >= STEPS and max(rewards[-15:]) >= 0.9, [round(r, 2) for r in rewards[::10]]
    assert facts["left_alive"] == [] and facts["cluster_released"] is True and facts["sockdirs_left"] == []

    # the first checkpoint the driver kept (step 8, unless it polled late; before any fault): each
    # rank's model equals a 1-host, 4-rank run's of as many steps
    kept = facts["kept"]
    steps = kept["step"]
    assert steps >= 8 and steps % 8 == 0
    assert {p: s["host"] for p, s in kept["shards"].items() if p.startswith("actor")} == {
        f"actor/0/{r}": h for r, h in ACTOR_HOSTS.items()}
    one = run_graph(ROOT / "graphs" / "ppo.yaml", tmp_path / "one-host", timeout_s=200, cwd=ROOT, overrides=[
        "nodes.actor.devices=4", f"schedule.steps={steps}", f"schedule.checkpoint_every={steps}"])
    assert one.exit_code == 0, one.stderr[-3000:]
    for rank in range(4):
        a = load_state(Path(kept["shards"][f"actor/0/{rank}"]["copy"]))["node"]
        b = node_state(one.run_dir, "actor", rank=rank)
        assert a["updates"] == b["updates"] == steps and set(a["model"]) == set(b["model"]) and a["model"]
        for name, tensor in a["model"].items():
            ref = b["model"][name].float()
            gap = (tensor.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12)
            assert gap <= 1e-5, (rank, name, float(gap))


def assert_links(facts: dict, where: dict) -> None:
    """Edges between hosts are tcp + CURVE bound to the consumer's host, ipc within one; the actor's
    ranks are one group with its store on rank 0's host and tcp + CURVE shard channels across hosts;
    the control is tcp + CURVE for host-b's processes; every listener is its host's address; a
    stranger's key is refused by a data channel, a rank's shard channel and the control."""
    specs = facts["specs"]
    for edge in ("prompts -> rollout", "rollout -> reward", "reward -> reference", "reference -> critic", "critic -> actor"):
        src, dst = (s.strip() for s in edge.split("->"))
        address = specs[f"{dst}.0.0"]["inputs"]["in"]
        if where[f"{src}.0.0"] == where[f"{dst}.0.0"]:
            assert address.startswith("ipc://") and "in" not in specs[f"{dst}.0.0"]["input_clients"], (edge, address)
        else:
            assert address.startswith(f"tcp://{ADDRESS[where[f'{dst}.0.0']]}:"), (edge, address)
            assert specs[f"{dst}.0.0"]["input_clients"]["in"] == [specs[f"{src}.0.0"]["curve_public"]], edge
    # rank 0 hears from host-b's ranks over tcp, ranks 2 and 3 from rank 0; rank 1 over ipc
    ranks = {r: specs[f"actor.0.{r}"] for r in range(4)}
    assert {tuple(spec["master"]) for spec in ranks.values()} == {("127.0.0.1", ranks[0]["master"][1])}
    shard = ranks[0]["rank_addresses"]
    assert all(spec["rank_addresses"] == shard for spec in ranks.values())
    assert shard[0].startswith("tcp://127.0.0.1:") and shard[1].startswith("ipc://")
    assert shard[2].startswith("tcp://127.0.0.2:") and shard[3].startswith("tcp://127.0.0.2:")
    keys = {r: spec["curve_public"] for r, spec in ranks.items()}
    assert ranks[0]["rank_clients"] == sorted([keys[1], keys[2], keys[3]]) and ranks[1]["rank_clients"] is None
    assert ranks[2]["rank_clients"] == [keys[0]] and ranks[0]["rank_keys"][2] == keys[2]
    for name, spec in specs.items():
        if spec["host"] == "host-b":
            assert spec["control"].startswith("tcp://127.0.0.1:") and spec["control_key"], (name, spec["control"])
        else:
            assert spec["control"].startswith("ipc://") and not spec["control_key"], (name, spec["control"])
        assert spec["host_address"] == ADDRESS[spec["host"]]
    # every listener of a node process is its host's address (gloo's too: the ranks on host-b bind
    # the interface that holds 127.0.0.2); never all interfaces
    for name, socks in facts["sockets"].items():
        assert {ip.rsplit(":", 1)[0] for ip in socks["listen"]} <= {ADDRESS[facts["hosts"][name]]}, (name, socks)
    for r in (2, 3):
        assert facts["sockets"][f"actor.0.{r}"]["listen"], f"actor rank {r}: its shard channel and gloo on host-b"
    assert facts["sockets"]["reward.0.0"]["listen"], "the tcp input of reward (fed from host-b)"
    control = [s for s in facts["controller_sockets"]["controller"]["listen"] if s.startswith("127.0.0.1:")]
    assert specs["rollout.0.0"]["control"] == f"tcp://{control[0]}"
    assert all(not s.startswith(("0.0.0.0", "::", "[::]")) or s.startswith("::ffff:127.")
               for s in facts["controller_sockets"]["controller"]["listen"])
    probes = facts["probes"]
    assert {k.rsplit(":", 1)[0] for k in probes if " rank " in k} == {
        "actor.0.0 rank tcp://127.0.0.1", "actor.0.2 rank tcp://127.0.0.2", "actor.0.3 rank tcp://127.0.0.2"}
    assert any(k.startswith("reward.0.0 tcp://127.0.0.1:") for k in probes) and any(k.startswith("control ") for k in probes)
    for what, outcome in probes.items():
        assert outcome == ("refused" if what.endswith("stranger") else "succeeded"), (what, outcome)
