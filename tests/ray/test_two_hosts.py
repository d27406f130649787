"""graphs/ppo.yaml under the Ray launcher on two "hosts" with distinct addresses — host-a at
127.0.0.1 (actor, critic, reference), host-b at 127.0.0.2 (prompts, rollout, reward) — inside a
network namespace this test makes (`unshare -n`; every packet stays in it). The run:

- learns (reward >= 0.9 in its last steps), every ticket consumed exactly once;
- sends the edges between the hosts over tcp with CURVE, and the control of host-b's processes
  too, while the edges within a host stay ipc (read from the plan, the specs and the sockets:
  every listener is its host's address, never 0.0.0.0); a stranger's CURVE key is refused;
- survives kill -9 of host-b's rollout process, then the loss of host-b itself (its processes
  are re-planned onto host-a, the ledger and the live view say so);
- leaves no process, actor or socket folder behind.

And the other way round: the trainers (stateful, and the weights' publisher) on the host that is
lost move to the other one, every stateful node rolls back to the last checkpoint, the weight
store moves with the actor, and the run still ends exactly once with every version published.

The scenario runs in tests/ray/two_hosts.py (inside the namespace); this file asserts on what it saw.
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

ROOT = Path(__file__).resolve().parents[2]
HOST_OF = {"actor": "host-a", "critic": "host-a", "reference": "host-a",
           "prompts": "host-b", "rollout": "host-b", "reward": "host-b"}
ADDRESS = {"host-a": "127.0.0.1", "host-b": "127.0.0.2"}
STEPS = 90
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
    assert "driver_error" not in facts, facts["driver_error"] + "\n" + facts.get("stderr", "")
    return facts


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_ppo_with_an_actor_spanning_two_hosts_learns_over_tcp_and_curve_survives_kill_9_of_a_rank_and_the_loss_of_a_host(tmp_path):
    hosts = [f"nodes.{node}.host={host}" for node, host in SPANNING.items()]
    facts = run_scenario(tmp_path, {
        "graph": str(ROOT / "graphs" / "ppo.yaml"),
        "overrides": ["launcher.type=ray", f"schedule.steps={STEPS}", "nodes.actor.devices=4", *hosts],
        "processes": 9, "timeout_s": 300, "kill": ["actor.0.2", 10], "remove_at_step": 40}, timeout_s=400)
    assert facts["ray_nodes"] == ADDRESS
    assert facts["rc"] == 0, facts["stderr"]
    where = {**{f"{n}.0.0": h for n, h in SPANNING.items()}, **{f"actor.0.{r}": h for r, h in ACTOR_HOSTS.items()}}
    # where each process ran, from its plan entry (ranks packed per host, in host order) and the process tree
    assert {name: spec["host"] for name, spec in facts["specs"].items()} == where
    assert facts["hosts"] == where
    # plan.json ends as re-planned (revision 1: host-b's processes on host-a, the actor's group whole)
    plan_end = {(e["node"], e["rank"]): e["host"] for e in json.loads((tmp_path / "run" / "plan.json").read_text())["plan"]}
    assert set(plan_end.values()) == {"host-a"}
    rows = [json.loads(line) for line in (tmp_path / "run" / "ledger.jsonl").read_text().splitlines()]
    assert [(r["revision"], r["moved"]) for r in rows if r["event"] == "plan"] == [
        (1, {"actor/0/2": "host-a", "actor/0/3": "host-a", "critic/0/0": "host-a", "rollout/0/0": "host-a"})]
    specs = facts["specs"]
    # edges: tcp + CURVE between hosts (bound to the consumer's host), ipc within one
    for edge in ("prompts -> rollout", "rollout -> reward", "reward -> reference", "reference -> critic", "critic -> actor"):
        src, dst = (s.strip() for s in edge.split("->"))
        address = specs[f"{dst}.0.0"]["inputs"]["in"]
        if where[f"{src}.0.0"] == where[f"{dst}.0.0"]:
            assert address.startswith("ipc://") and "in" not in specs[f"{dst}.0.0"]["input_clients"], (edge, address)
        else:
            assert address.startswith(f"tcp://{ADDRESS[where[f'{dst}.0.0']]}:"), (edge, address)
            assert specs[f"{dst}.0.0"]["input_clients"]["in"] == [specs[f"{src}.0.0"]["curve_public"]], edge
    # the actor's ranks: one group with its store on rank 0's host; shard channels tcp + CURVE across
    # hosts (rank 0 hears from host-b's ranks, ranks 2 and 3 from rank 0), ipc for rank 1
    ranks = {r: specs[f"actor.0.{r}"] for r in range(4)}
    assert {tuple(spec["master"]) for spec in ranks.values()} == {("127.0.0.1", ranks[0]["master"][1])}
    shard = ranks[0]["rank_addresses"]
    assert all(spec["rank_addresses"] == shard for spec in ranks.values())
    assert shard[0].startswith("tcp://127.0.0.1:") and shard[1].startswith("ipc://")
    assert shard[2].startswith("tcp://127.0.0.2:") and shard[3].startswith("tcp://127.0.0.2:")
    keys = {r: spec["curve_public"] for r, spec in ranks.items()}
    assert ranks[0]["rank_clients"] == sorted([keys[1], keys[2], keys[3]]) and ranks[1]["rank_clients"] is None
    assert ranks[2]["rank_clients"] == [keys[0]] and ranks[0]["rank_keys"][2] == keys[2]
    # control: tcp + CURVE for host-b's processes, ipc on the controller's own host
    for name, spec in specs.items():
        if spec["host"] == "host-b":
            assert spec["control"].startswith("tcp://127.0.0.1:") and spec["control_key"], (name, spec["control"])
        else:
            assert spec["control"].startswith("ipc://") and not spec["control_key"], (name, spec["control"])
        assert spec["host_address"] == ADDRESS[spec["host"]]
    # sockets: every listener of a node process is its host's address (gloo's too: the ranks on
    # host-b bind the interface that holds 127.0.0.2); never all interfaces
    for name, socks in facts["sockets"].items():
        assert {ip.rsplit(":", 1)[0] for ip in socks["listen"]} <= {ADDRESS[facts["hosts"][name]]}, (name, socks)
    for r in (2, 3):
        assert facts["sockets"][f"actor.0.{r}"]["listen"], f"actor rank {r}: its shard channel and gloo on host-b"
    assert facts["sockets"]["reward.0.0"]["listen"], "the tcp input of reward (fed from host-b)"
    control = [s for s in facts["controller_sockets"]["controller"]["listen"] if s.startswith("127.0.0.1:")]
    assert specs["rollout.0.0"]["control"] == f"tcp://{control[0]}"
    assert all(not s.startswith(("0.0.0.0", "::", "[::]")) or s.startswith("::ffff:127.")
               for s in facts["controller_sockets"]["controller"]["listen"])
    # a stranger's key is refused by a data channel, a rank's shard channel and the control; the run's own keys are not
    probes = facts["probes"]
    assert {k.rsplit(":", 1)[0] for k in probes if " rank " in k} == {
        "actor.0.0 rank tcp://127.0.0.1", "actor.0.2 rank tcp://127.0.0.2", "actor.0.3 rank tcp://127.0.0.2"}
    assert any(k.startswith("reward.0.0 tcp://127.0.0.1:") for k in probes) and any(k.startswith("control ") for k in probes)
    for what, outcome in probes.items():
        assert outcome == ("refused" if what.endswith("stranger") else "succeeded"), (what, outcome)
    # kill -9 of a rank on host-b: its whole group restarts (once), then host-b is lost: what ran
    # there moves to host-a, the actor's group whole
    assert facts["killed"][0] == "actor.0.2"
    first = facts["node_down"][:4]
    assert first[0] == "actor/0/2" and sorted(first) == [f"actor/0/{r}" for r in range(4)], facts["node_down"]
    assert facts["replanned"] and facts["replanned"][0]["host"] == "host-b"
    assert facts["replanned"][0]["moved"] == {"actor/0/2": "host-a", "actor/0/3": "host-a", "critic/0/0": "host-a",
                                              "rollout/0/0": "host-a"}
    assert set(facts["hosts_after"].values()) == {"host-a"}
    assert "replanned host-b lost: actor/0/2 -> host-a" in facts["stdout"]
    assert facts["status"]["replanned"]
    # exactly once (rollbacks replayed steps: more rows than steps), learned, nothing left
    assert facts["audit"] == {"exactly_once": True, "issued": STEPS, "lost": [], "duplicated": []}
    rewards = facts["rewards"]
    assert len(rewards) >= STEPS and max(rewards[-15:]) >= 0.9, [round(r, 2) for r in rewards[::10]]
    assert facts["left_alive"] == [] and facts["cluster_released"] is True and facts["sockdirs_left"] == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_losing_the_trainers_host_moves_actor_and_critic_rolls_back_and_weights_follow_the_publisher(tmp_path):
    steps = 30
    trainers_on_b = {**HOST_OF, "actor": "host-b", "critic": "host-b", "prompts": "host-a", "rollout": "host-a",
                     "reward": "host-a"}
    hosts = [f"nodes.{node}.host={host}" for node, host in trainers_on_b.items()]
    facts = run_scenario(tmp_path, {
        "graph": str(ROOT / "graphs" / "ppo.yaml"),
        "overrides": ["launcher.type=ray", f"schedule.steps={steps}", "schedule.checkpoint_every=5", *hosts],
        "processes": 6, "timeout_s": 200, "kill": None, "remove_at_step": 10}, timeout_s=280)
    assert facts["rc"] == 0, facts["stderr"]
    assert facts["specs"]["actor.0.0"]["host_address"] == "127.0.0.2"
    assert facts["specs"]["critic.0.0"]["inputs"]["in"].startswith("tcp://127.0.0.2:")  # fed by reference on host-a
    assert facts["replanned"][0]["moved"] == {"actor/0/0": "host-a", "critic/0/0": "host-a"}
    assert facts["recoveries"], "moving the trainers rolls every stateful node back"
    assert set(facts["hosts_after"].values()) == {"host-a"}
    assert facts["audit"] == {"exactly_once": True, "issued": steps, "lost": [], "duplicated": []}
    assert facts["versions"][-1] == steps - 1  # the moved actor published every version, the rollout took them
    assert facts["left_alive"] == [] and facts["cluster_released"] is True and facts["sockdirs_left"] == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_actor_whose_ranks_span_two_hosts_trains_the_same_parameters_as_four_ranks_on_one_host(tmp_path):
    from flowrl.testing import node_state
    from flowrl.testing.harness import run_graph

    steps, same = 8, ["nodes.actor.devices=4", "schedule.steps=8", "schedule.checkpoint_every=8"]
    hosts = [f"nodes.{node}.host={host}" for node, host in SPANNING.items()]
    facts = run_scenario(tmp_path, {"graph": str(ROOT / "graphs" / "ppo.yaml"),
                                    "overrides": ["launcher.type=ray", *same, *hosts], "processes": 9,
                                    "timeout_s": 200, "kill": None, "remove_at_step": None}, timeout_s=280)
    assert facts["rc"] == 0, facts["stderr"]
    assert {n: h for n, h in facts["hosts"].items() if n.startswith("actor")} == {
        f"actor.0.{r}": h for r, h in ACTOR_HOSTS.items()}
    assert facts["node_down"] == [] and facts["audit"]["exactly_once"]  # fault-free: nothing restarted
    one = run_graph(ROOT / "graphs" / "ppo.yaml", tmp_path / "one-host", overrides=same, timeout_s=200, cwd=ROOT)
    assert one.exit_code == 0, one.stderr[-3000:]
    two = tmp_path / "run"
    for rank in range(4):  # each rank's model after 8 PPO updates, from the final checkpoint of each run
        a, b = node_state(two, "actor", rank=rank)["model"], node_state(one.run_dir, "actor", rank=rank)["model"]
        assert set(a) == set(b) and a and node_state(two, "actor", rank=rank)["updates"] == steps
        for name, tensor in a.items():
            gap = (tensor.float() - b[name].float()).abs().max() / b[name].float().abs().max().clamp_min(1e-12)
            assert gap <= 1e-5, (rank, name, float(gap))
    assert json.loads((two / "checkpoints" / "latest.json").read_text())["step"] == steps
