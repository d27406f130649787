"""`flowrl scale` on a run that spans two "hosts" (127.0.0.1 and 127.0.0.2 inside a network namespace,
tests/ray/two_hosts.py, 2 CPUs each): graphs/ppo.yaml with actor, reference and prompts on host-a,
critic and reward on host-b; rollout is not pinned, and the planner puts rollout/0 on host-a.
`flowrl scale RUN rollout=2` while it runs: no host has a free core (six processes on four), so the
new replica time-shares the cores of the host that carries the least (host-b: critic and reward)
— the other host. It is wired over tcp + CURVE (its input from prompts on host-a; its output into
reward's CURVE input, which admits its key by an `Admit` order; its control), takes the current
weights and generates; then `rollout=1` removes it with the hand-off, and its key is refused again
by the control and by reward. The run ends exactly once with no restart; RUN_DIR/plan.json ends
without rollout/1 and the ledger has both plan changes. (Choosing a host with free cores first is
tests/runtime/test_scale_hosts.py.) `ticket: group` (one prompt per ticket, 8 per update) keeps
several tickets in flight, so a second rollout replica has work to take (with one batch per step,
the first replica, which acknowledges at once, is never short of credit and takes every batch).
Needs the `ray` extra and `unshare` + `ip` (root, or unprivileged user namespaces).
"""

from __future__ import annotations

import pytest

from tests.ray.test_two_hosts import ROOT, run_scenario

HOST_OF = {"actor": "host-a", "critic": "host-b", "reward": "host-b", "prompts": "host-a", "reference": "host-a"}
ADDRESS = {"host-a": "127.0.0.1", "host-b": "127.0.0.2"}
STEPS = 100
TICKETS = STEPS * 8


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_scale_up_places_a_replica_on_the_other_host_with_keys_admitted_then_scale_down_revokes_them(tmp_path):
    hosts = [f"nodes.{node}.host={host}" for node, host in HOST_OF.items()]
    facts = run_scenario(tmp_path, {
        "graph": str(ROOT / "graphs" / "ppo.yaml"), "overrides": ["launcher.type=ray", f"schedule.steps={STEPS}", "schedule.ticket=group", "schedule.batch_size=8",
                     "nodes.critic.config.train.mini_batches=2", "nodes.actor.config.train.mini_batches=2", *hosts],
        "processes": 6, "timeout_s": 300, "kill": None, "remove_at_step": None,
        "scale": [[3, "rollout", 2], [50, "rollout", 1]]}, timeout_s=400)
    assert "scale_error" not in facts, facts["scale_error"] + "\n" + facts["stderr"]
    assert facts["rc"] == 0, facts["stderr"]
    assert facts["hosts"]["rollout.0.0"] == "host-a"  # the planner's choice (rollout is not pinned)
    up, down = facts["scale"]
    assert up["rc"] == 0 and "rollout: 1 -> 2 replica(s)" in up["out"], up["out"]
    assert down["rc"] == 0 and "rollout: 2 -> 1 replica(s)" in down["out"], down["out"]
    # the new replica went to the host whose cores carry the least: the other one
    assert up["hosts"]["rollout.1.0"] == "host-b"
    spec = up["specs"]["rollout.1.0"]
    assert spec["host"] == "host-b" and spec["host_address"] == ADDRESS["host-b"]
    # its input from prompts (host-a) is tcp on its own host's address, admitting prompts' key only
    prompts, reward = up["specs"]["prompts.0.0"], up["specs"]["reward.0.0"]
    assert spec["inputs"]["in"].startswith("tcp://127.0.0.2:") and spec["input_clients"]["in"] == [prompts["curve_public"]]
    # its control is tcp + CURVE to the controller's host; its output goes to reward's tcp input
    assert spec["control"].startswith("tcp://127.0.0.1:") and spec["control_key"]
    assert reward["inputs"]["in"].startswith("tcp://127.0.0.2:")
    (to_reward,) = spec["outputs"]["rollout.out -> reward.in"]
    assert to_reward.startswith("tcp://127.0.0.2:") and to_reward[len("tcp://"):] in up["sockets"]["reward.0.0"]["listen"]
    # sockets: it listens on host-b's address only; prompts is connected to its input, it to reward's
    listen = up["sockets"]["rollout.1.0"]["listen"]
    assert listen and {a.rsplit(":", 1)[0] for a in listen} == {"127.0.0.2"}, listen
    assert {remote for _, remote in up["sockets"]["prompts.0.0"]["peers"]} & set(listen)
    assert any(remote == to_reward[len("tcp://"):] for _, remote in up["sockets"]["rollout.1.0"]["peers"])
    # keys: a made-up key is still refused by the control; the new one is admitted by the control and
    # reward; its own input refuses a stranger and admits prompts
    probes = up["probes"]
    assert probes["control after scale stranger"] == "refused"
    assert probes["control rollout.1.0"] == "succeeded"
    assert probes[f"reward.0.0 {to_reward} rollout.1.0"] == "succeeded"
    assert any(k.startswith("rollout.1.0 tcp://127.0.0.2:") and k.endswith(" stranger") for k in probes), probes
    for what, outcome in probes.items():
        assert outcome == ("refused" if what.endswith("stranger") else "succeeded"), (what, outcome)
    # it generated: tickets went through replica 1 (its spans in the trace)
    print("rollout/1 took work:", up["first_batch"], len(facts["handled"].get("rollout/1", [])), "ticket(s)")
    assert up["first_batch"] and facts["handled"].get("rollout/1"), sorted(facts["handled"])
    # removed with the hand-off: its key refused again by the control and by reward
    assert down["probes"] == {"control rollout.1.0 removed": "refused",
                              f"reward.0.0 {to_reward} rollout.1.0 removed": "refused"}, down["probes"]
    # plan.json: the change, then back; the ledger keeps the history
    plan = facts["plan_end"]
    assert plan["revision"] == 2 and not [e for e in plan["plan"] if e["node"] == "rollout" and e["replica"] == 1]
    assert [(r["revision"], r["added"], r["removed"]) for r in facts["plan_events"]] == [
        (1, {"rollout/1/0": "host-b"}, []), (2, {}, ["rollout/1/0"])]
    assert [(r["was"], r["replicas"]) for r in facts["scaled"]] == [(1, 2), (2, 1)]
    # exactly once, no restart, nothing left
    assert facts["node_down"] == [] and facts["recoveries"] == []
    assert facts["audit"] == {"exactly_once": True, "issued": TICKETS, "lost": [], "duplicated": []}
    assert facts["left_alive"] == [] and facts["cluster_released"] is True and facts["sockdirs_left"] == []
