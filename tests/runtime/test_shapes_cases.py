"""Each way the first runtime lost work or hung in a graph that is not a chain, as a real run.

Synthetic nodes (flowrl/testing/nodes.py) keep their state as hash chains, so "every ticket
folded in once, in order" is checked bitwise against the chain a fault-free run computes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.testing import node_state, run_graph
from flowrl.testing.nodes import chain_digest

pytestmark = pytest.mark.timeout(180)

N = "flowrl.testing.nodes"
FAST = "supervision: {heartbeat_s: 0.2, deadline_s: 2.0, process_timeout_s: 3.0}"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "graph.yaml"
    path.write_text(text)
    return path


def expected_chain(steps: int, size: int, factor: int = 1, count: bool = False) -> str:
    """The hash chain of tickets 0..steps-1 as Numbers (x = index*size ...) and Scale make them."""
    import numpy as np

    from flowrl.transport import Batch

    chain = ""
    for i in range(steps):
        x = np.arange(i * size, (i + 1) * size, dtype=np.int64) * factor
        chain = chain_digest(chain, Batch(tensors={"x": x}, batch_id=f"t-{i:06d}"))
    return chain


def ok(result, steps: int, sinks: list[str]):
    assert result.exit_code == 0, result.stderr[-3000:]
    audit = result.audit(sinks)
    assert audit.exactly_once, (audit.lost[:5], audit.duplicated[:5])
    assert len(audit.issued) == steps


CHAIN = f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  norm: {{kind: "{N}:Normalizer", config: {{delay_s: 0.02}}}}
  collect: {{kind: "{N}:Chain"}}
edges: [numbers -> norm, norm -> collect]
schedule: {{steps: 14, batch_size: 2, max_staleness: 2, checkpoint_every: 4}}
{FAST}
"""


@pytest.mark.parametrize("fault", ["kill:norm@step=7", "kill:collect@step=9"])
def test_a_stateful_transform_and_its_sink_roll_back_together_whichever_dies(tmp_path, fault):
    """Cases 1 and 2: the normaliser killed, or the sink killed: both states hold every ticket once."""
    result = run_graph(write(tmp_path, CHAIN), tmp_path / "run", faults=[fault], timeout_s=150)
    ok(result, 14, ["collect"])
    norm, collect = node_state(result.run_dir, "norm"), node_state(result.run_dir, "collect")
    assert norm["count"] == 14 and norm["chain"] == expected_chain(14, 2)
    assert [bid for bid, _ in collect["seen"]] == [f"t-{i:06d}" for i in range(14)]
    assert any(r["event"] == "recovery" for r in result.ledger)


def test_killing_the_critic_of_ppo_leaves_it_with_one_update_per_step(tmp_path):
    """Case 1 on the real graph: 58 critic updates for 60 steps before."""
    result = run_graph("graphs/ppo.yaml", tmp_path / "run", cwd=Path(__file__).resolve().parents[2],
                       overrides=["schedule.steps=16", "schedule.checkpoint_every=5", "schedule.batch_size=8"],
                       faults=["kill:critic@step=8"], timeout_s=170)
    ok(result, 16, ["actor"])
    assert node_state(result.run_dir, "critic")["updates"] == 16
    assert node_state(result.run_dir, "actor")["updates"] == 16


TWO_SINKS = f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  norm: {{kind: "{N}:Normalizer"}}
  a: {{kind: "{N}:Chain"}}
  b: {{kind: "{N}:Chain", config: {{delay_s: 0.03}}}}
  log: {{kind: "{N}:Logger"}}
edges: [numbers -> norm, norm -> a, norm -> b, norm -> log]
schedule: {{steps: 12, batch_size: 2, max_staleness: 2, checkpoint_every: 3}}
{FAST}
"""


@pytest.mark.parametrize("fault", ["kill:a@step=6", "kill:log@step=4", "kill:b@checkpoint=6"])
def test_several_sinks_with_and_without_state_each_consume_every_ticket_once(tmp_path, fault):
    """Cases 3, 4 and 8: a stateful sink of two, a stateless sink, and a kill while a checkpoint
    is being saved (its half-written checkpoint never commits)."""
    result = run_graph(write(tmp_path, TWO_SINKS), tmp_path / "run", faults=[fault], timeout_s=150)
    ok(result, 12, ["a", "b", "log"])
    for sink in ("a", "b"):
        assert [bid for bid, _ in node_state(result.run_dir, sink)["seen"]] == [f"t-{i:06d}" for i in range(12)]
    assert node_state(result.run_dir, "norm")["chain"] == expected_chain(12, 2)


JOIN = f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  left: {{kind: "{N}:Scale", config: {{factor: 2}}}}
  right: {{kind: "{N}:Scale", config: {{factor: 3}}}}
  pair: {{kind: "{N}:Pair"}}
  collect: {{kind: "{N}:Chain"}}
edges: [numbers -> left, numbers -> right, left -> pair.a, right -> pair.b, pair -> collect]
schedule: {{steps: 10, batch_size: 2, max_staleness: 2, ticket_timeout_s: 2.0}}
{FAST}
"""


def test_a_join_survives_lost_and_duplicated_parts(tmp_path):
    """Case 5: a part lost (re-issued after the timeout) and a branch killed (its parts sent twice)."""
    result = run_graph(write(tmp_path, JOIN), tmp_path / "run", faults=["drop:left@step=2", "kill:right@step=5"],
                       timeout_s=150)
    ok(result, 10, ["collect"])
    seen = node_state(result.run_dir, "collect")["seen"]
    assert [bid for bid, _ in seen] == [f"t-{i:06d}" for i in range(10)]
    assert all(s == 5 * sum(range(i * 2, i * 2 + 2)) for i, (_, s) in enumerate(seen))


@pytest.mark.parametrize("empty", [False, True])
def test_a_filter_that_drops_tickets_lets_the_run_finish_without_reissues(tmp_path, empty):
    """Case 6: dropping is an outcome, not a loss — no ticket waits for its timeout."""
    text = f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  filter: {{kind: "{N}:DropEvery", config: {{every: 3, remainder: 1, keep: 1, empty: {str(empty).lower()}}}}}
  norm: {{kind: "{N}:Normalizer"}}
  collect: {{kind: "{N}:Chain"}}
  log: {{kind: "{N}:Logger"}}
edges: [numbers -> filter, filter -> norm, norm -> collect, filter -> log]
schedule: {{steps: 12, batch_size: 3, max_staleness: 1, ticket_timeout_s: 60}}
{FAST}
"""
    result = run_graph(write(tmp_path, text), tmp_path / "run", timeout_s=120)
    ok(result, 12, ["collect", "log"])
    assert not any(r["event"] == "reissued" for r in result.ledger)  # none waited for its 60 s timeout
    dropped = sorted({r["batch_id"] for r in result.ledger if r["event"] == "dropped"})
    assert dropped == [f"t-{i:06d}" for i in range(12) if i % 3 == 1]
    seen = node_state(result.run_dir, "collect")["seen"]
    assert [bid for bid, _ in seen] == [f"t-{i:06d}" for i in range(12) if i % 3 != 1]
    assert all(s == i * 3 for i, (_, s) in zip([i for i in range(12) if i % 3 != 1], seen))  # shrunk to 1 sample
    assert node_state(result.run_dir, "norm")["count"] == 8  # the markers passed through it without a call


def test_a_node_stuck_inside_process_is_declared_hung_and_replaced(tmp_path):
    """Case 7: its heartbeat thread goes on; the call's duration gives it away."""
    result = run_graph(write(tmp_path, CHAIN), tmp_path / "run", faults=["stall:norm@step=3"], timeout_s=150)
    ok(result, 14, ["collect"])
    down = [r for r in result.ledger if r["event"] == "node_down"]
    assert down and "inside one call" in down[0]["why"] and "process_timeout_s" in down[0]["why"]


def test_a_ticket_that_never_completes_fails_the_run_naming_it_and_where_it_was(tmp_path):
    """Case 7: re-issues are bounded by max_attempts; the error names the ticket and the node."""
    text = CHAIN.replace("max_staleness: 2, checkpoint_every: 4", "max_staleness: 0, ticket_timeout_s: 1.0, max_attempts: 3")
    text = text.replace("process_timeout_s: 3.0", "process_timeout_s: 60")
    result = run_graph(write(tmp_path, text), tmp_path / "run", faults=["slow:norm,seconds=600"], timeout_s=120)
    assert result.exit_code == 1
    assert "ticket t-000000 (index 0) was issued 3 times" in result.stderr, result.stderr[-2000:]
    assert "norm/0/0" in result.stderr  # where it was stuck
    # failed at its third timeout, while norm was still inside its call (endless: 600 s, so however
    # late the timeouts come; the run's stop kills it): not when the call returned, no fourth attempt
    mine = [r["event"] for r in result.ledger if r["batch_id"] == "t-000000"]
    assert mine == ["issued", "reissued", "reissued"], mine
    assert [r["event"] for r in result.ledger if r["event"] == "failed"] == ["failed"]


def test_a_failed_weight_broadcast_keeps_the_previous_version_whole(tmp_path):
    """Case 9: label and content agree after a failed sync (Follower checks it on every batch)."""
    text = f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  follower: {{kind: "{N}:Follower", config: {{size: 300000}}}}
  trainer: {{kind: "{N}:Trainer", config: {{size: 300000}}}}
edges: [numbers -> follower, follower -> trainer]
weights: [trainer -> follower]
schedule: {{steps: 8, batch_size: 2, max_staleness: 1}}
{FAST}
"""
    result = run_graph(write(tmp_path, text), tmp_path / "run", faults=["fail_sync:follower@version=3"], timeout_s=150)
    ok(result, 8, ["trainer"])
    assert "weight sync failed" in result.stderr or result.log("follower.0.0").count("sync") >= 0


@pytest.mark.parametrize("calls", ["", "concurrency: 4, "])
def test_a_users_exception_is_reported_with_its_type_file_and_line_and_a_repeat_fails_fast(tmp_path, calls):
    """Case 12: the last-error line names the user's error, not anyio's ExceptionGroup; the same
    error at the same ticket after a restart ends the run without burning the budget. With
    `concurrency` the error comes to the event loop from the call's task."""
    text = f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  faulty: {{kind: "{N}:Faulty", {calls}config: {{fail_at: 3}}, on_failure: {{max_restarts: 5, backoff_s: 0}}}}
  collect: {{kind: "{N}:Chain"}}
edges: [numbers -> faulty, faulty -> collect]
schedule: {{steps: 6, batch_size: 2}}
{FAST}
"""
    result = run_graph(write(tmp_path, text), tmp_path / "run", timeout_s=120)
    assert result.exit_code == 1
    err = result.stderr
    assert "KeyError: 'scores'" in err and "flowrl/testing/nodes.py:" in err and "ticket t-000003" in err
    assert "ExceptionGroup" not in err.split("last log lines")[0]
    assert "same error at the same ticket" in err
    downs = [r for r in result.ledger if r["event"] == "node_down"]
    assert len(downs) == 2  # the first failure and its repeat, not the budget of 5


def test_a_wrong_return_type_is_named_at_the_nodes_boundary(tmp_path):
    text = f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  faulty: {{kind: "{N}:Faulty", config: {{bad_return: true}}, on_failure: {{policy: fail}}}}
  collect: {{kind: "{N}:Chain"}}
edges: [numbers -> faulty, faulty -> collect]
schedule: {{steps: 3, batch_size: 2}}
{FAST}
"""
    result = run_graph(write(tmp_path, text), tmp_path / "run", timeout_s=120)
    assert result.exit_code == 1
    assert "node 'faulty': process() returned list; return a flowrl.Batch" in result.stderr


def test_a_node_whose_process_is_not_async_is_refused_when_the_graph_loads(tmp_path):
    mod = tmp_path / "syncnode.py"
    mod.write_text("import flowrl\n\nclass Plain(flowrl.Node):\n    def process(self, batch, port):\n        return batch\n")
    text = f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  plain: {{kind: "syncnode:Plain"}}
  collect: {{kind: "{N}:Collect"}}
edges: [numbers -> plain, plain -> collect]
"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "flowrl", "check", str(write(tmp_path, text))], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "syncnode.Plain.process is not async" in out.stdout + out.stderr


def test_flowrl_run_in_python_passes_the_callers_import_path_to_node_processes(tmp_path, monkeypatch):
    import flowrl

    pkg = tmp_path / "elsewhere"
    pkg.mkdir()
    (pkg / "mynodes.py").write_text(
        "import flowrl\n\nclass Double(flowrl.Node):\n    async def process(self, batch, port):\n"
        "        return batch.replace(tensors={'x': batch.tensors['x'] * 2})\n")
    monkeypatch.syspath_prepend(str(pkg))
    monkeypatch.chdir(tmp_path)
    spec = flowrl.GraphSpec(name="path", nodes={"numbers": {"kind": f"{N}:Numbers"}, "double": {"kind": "mynodes:Double"},
                                                  "collect": {"kind": f"{N}:Collect"}},
                            edges=["numbers -> double", "double -> collect"], schedule={"steps": 3, "batch_size": 2})
    summary = flowrl.run(spec, run_dir=tmp_path / "run")
    assert summary.exit_code == 0


ALL_BF16 = [f"nodes.{n}.dtype=bfloat16" for n in ("prompts", "rollout", "reward", "reference", "advantages", "actor")]


def test_an_all_bfloat16_graph_syncs_weights_in_the_serving_dtype(tmp_path):
    """Case 10: the actor keeps fp32 master weights and publishes bfloat16 to the bf16 rollout."""
    result = run_graph("graphs/grpo.yaml", tmp_path / "run", cwd=Path(__file__).resolve().parents[2],
                       overrides=["schedule.steps=4", "schedule.batch_size=4", *ALL_BF16], timeout_s=170,
                       env={"FLOWRL_WEIGHT_DIGEST": "1"})
    ok(result, 4, ["actor"])
    digests = {}
    for r in result.ledger:
        if r["event"] == "weights":
            digests.setdefault(r["version"], set()).add(r["digest"])
    assert digests and all(len(d) == 1 for d in digests.values()), digests  # rollout == actor's serving copy


def test_a_model_mismatch_between_trainer_and_rollout_fails_the_run_naming_the_tensor(tmp_path):
    result = run_graph("graphs/grpo.yaml", tmp_path / "run", cwd=Path(__file__).resolve().parents[2],
                       overrides=["schedule.steps=3", "nodes.rollout.config.model.d_model=64"], timeout_s=170)
    assert result.exit_code == 1
    assert "cannot take the trainer's weights" in result.stderr and "differs" in result.stderr


def test_a_producer_that_never_makes_what_its_consumer_requires_fails_the_run_naming_it(tmp_path):
    """A batch refused at a node's boundary is said on the controller's log at once; when the
    ticket's next attempt is refused too, the run fails naming the edge and what is missing (it
    went on re-issuing until `max_attempts` timeouts, with the reason only in the node's log)."""
    text = f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  norm: {{kind: "{N}:WantsScores"}}
  collect: {{kind: "{N}:Chain"}}
edges: [numbers -> norm, norm -> collect]
schedule: {{steps: 4, batch_size: 2, max_staleness: 1, ticket_timeout_s: 1.0}}
{FAST}
"""
    result = run_graph(write(tmp_path, text), tmp_path / "run", timeout_s=150)
    assert result.exit_code == 1
    assert "refused t-000000 (attempt 0)" in result.stderr  # said before the run failed
    failure = result.stderr[result.stderr.index("run failed"):]
    assert "refused t-000000 at attempts 0 and 1" in failure and "numbers->norm" in failure
    assert "no tensor 'scores'" in failure and "`requires`" in failure
    assert not any(r["event"] == "node_down" for r in result.ledger)  # refused, never restarted


def test_a_forged_batch_is_rejected_at_the_nodes_boundary_without_a_restart(tmp_path):
    """Issue 12: a well-formed batch with the wrong tensors and the next index restarts nothing,
    and the real batch of that index is still taken."""
    text = f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  norm: {{kind: "{N}:Normalizer"}}
  collect: {{kind: "{N}:Chain"}}
edges: [numbers -> norm, norm -> collect]
schedule: {{steps: 8, batch_size: 2, max_staleness: 1}}
{FAST}
"""
    result = run_graph(write(tmp_path, text.replace("Normalizer", "StrictNormalizer")), tmp_path / "run",
                       faults=["forge:numbers@step=2"], timeout_s=150)
    ok(result, 8, ["collect"])
    assert not any(r["event"] == "node_down" for r in result.ledger)
    rejected = [r for r in result.ledger if r["event"] == "duplicate_dropped" and "invalid" in r.get("why", "")]
    assert len(rejected) == 1 and "no tensor 'x'" in rejected[0]["why"]
    assert node_state(result.run_dir, "norm")["chain"] == expected_chain(8, 2)
