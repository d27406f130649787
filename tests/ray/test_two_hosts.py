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
    cmd = [*namespace_prefix(), "sh", "-c", f'ip link set lo up && exec "{sys.executable}" -m tests.ray.two_hosts "{path}"']
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, env=env)
    assert proc.returncode == 0 and Path(scenario["out"]).exists(), proc.stderr[-3000:]
    facts = json.loads(Path(scenario["out"]).read_text())
    assert "driver_error" not in facts, facts["driver_error"] + "\n" + facts.get("stderr", "")
    return facts


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_ppo_split_over_two_hosts_learns_over_tcp_and_curve_and_survives_kill_9_and_the_loss_of_a_host(tmp_path):
    hosts = [f"nodes.{node}.host={host}" for node, host in HOST_OF.items()]
    facts = run_scenario(tmp_path, {
        "graph": str(ROOT / "graphs" / "ppo.yaml"), "overrides": ["launcher.type=ray", f"schedule.steps={STEPS}", *hosts],
        "processes": 6, "timeout_s": 300, "kill": ["rollout.0.0", 10], "remove_at_step": 40}, timeout_s=400)
    assert facts["ray_nodes"] == ADDRESS
    assert facts["rc"] == 0, facts["stderr"]
    # where each process ran, from the plan and from the process tree
    # plan.json ends as re-planned (revision 1: host-b's processes on host-a), the ledger says so
    plan = {(e["node"]): e["host"] for e in json.loads((tmp_path / "run" / "plan.json").read_text())["plan"]}
    assert plan == {**HOST_OF, "prompts": "host-a", "rollout": "host-a", "reward": "host-a"}
    rows = [json.loads(line) for line in (tmp_path / "run" / "ledger.jsonl").read_text().splitlines()]
    assert [(r["revision"], r["moved"]) for r in rows if r["event"] == "plan"] == [
        (1, {"prompts/0/0": "host-a", "rollout/0/0": "host-a", "reward/0/0": "host-a"})]
    assert facts["hosts"] == {f"{n}.0.0": h for n, h in HOST_OF.items()}
    specs = facts["specs"]
    # edges: tcp + CURVE between hosts (bound to the consumer's host), ipc within one
    for edge in ("prompts -> rollout", "rollout -> reward", "reward -> reference", "reference -> critic", "critic -> actor"):
        src, dst = (s.strip() for s in edge.split("->"))
        address = specs[f"{dst}.0.0"]["inputs"]["in"]
        if HOST_OF[src] == HOST_OF[dst]:
            assert address.startswith("ipc://") and "in" not in specs[f"{dst}.0.0"]["input_clients"], (edge, address)
        else:
            assert address.startswith(f"tcp://{ADDRESS[HOST_OF[dst]]}:"), (edge, address)
            assert specs[f"{dst}.0.0"]["input_clients"]["in"] == [specs[f"{src}.0.0"]["curve_public"]], edge
    # control: tcp + CURVE for host-b's processes, ipc on the controller's own host
    for name, spec in specs.items():
        if spec["host"] == "host-b":
            assert spec["control"].startswith("tcp://127.0.0.1:") and spec["control_key"], (name, spec["control"])
        else:
            assert spec["control"].startswith("ipc://") and not spec["control_key"], (name, spec["control"])
        assert spec["host_address"] == ADDRESS[spec["host"]]
    # sockets: every listener of a node process is its host's address; never all interfaces
    for name, socks in facts["sockets"].items():
        assert {ip.rsplit(":", 1)[0] for ip in socks["listen"]} <= {ADDRESS[facts["hosts"][name]]}, (name, socks)
    assert facts["sockets"]["reference.0.0"]["listen"], "the tcp input of reference (fed from host-b)"
    assert facts["sockets"]["rollout.0.0"]["listen"], "rollout's weight-sync (gloo) socket on host-b's address"
    control = [s for s in facts["controller_sockets"]["controller"]["listen"] if s.startswith("127.0.0.1:")]
    assert specs["rollout.0.0"]["control"] == f"tcp://{control[0]}"
    assert all(not s.startswith(("0.0.0.0", "::", "[::]")) or s.startswith("::ffff:127.")
               for s in facts["controller_sockets"]["controller"]["listen"])
    # a stranger's key is refused by the data channel and the control; the run's own keys are not
    probes = facts["probes"]
    assert any(k.startswith("reference.0.0 tcp://127.0.0.1:") for k in probes) and any(k.startswith("control ") for k in probes)
    for what, outcome in probes.items():
        assert outcome == ("refused" if what.endswith("stranger") else "succeeded"), (what, outcome)
    # kill -9 on host-b, then host-b lost: re-planned onto host-a
    assert facts["killed"][0] == "rollout.0.0"
    assert facts["replanned"] and facts["replanned"][0]["host"] == "host-b"
    assert facts["replanned"][0]["moved"] == {"prompts/0/0": "host-a", "rollout/0/0": "host-a", "reward/0/0": "host-a"}
    assert set(facts["hosts_after"].values()) == {"host-a"}
    assert "replanned host-b lost: prompts/0/0 -> host-a" in facts["stdout"]
    assert facts["status"]["replanned"]
    # exactly once, learned, nothing left
    assert facts["audit"] == {"exactly_once": True, "issued": STEPS, "lost": [], "duplicated": []}
    rewards = facts["rewards"]
    assert len(rewards) == STEPS and max(rewards[-15:]) >= 0.9, [round(r, 2) for r in rewards[::10]]
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
