"""Fused nodes at run time (`fuse_into`, flowrl/runtime/worker/fused.py): the host's process runs
them inside its call, the results are the unfused graph's, and a fault of the host (or of a fused
node) is the host's, restarted and replayed exactly once."""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
import numpy as np
import pytest

from flowrl.graph import load_graph_text
from flowrl.node import Drop, NodeContext
from flowrl.runtime.worker.contract import NodeContractError
from flowrl.runtime.worker.fused import node_class
from flowrl.testing import node_state, run_graph
from flowrl.transport import Batch

pytestmark = pytest.mark.timeout(180)

N = "flowrl.testing.nodes"
GRAPH = f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  scale: {{kind: "{N}:Scale", config: {{factor: 3}}}}
  drop: {{kind: "{N}:DropEvery", fuse_into: scale, config: {{every: 3, remainder: 1}}}}
  twice: {{kind: "{N}:Scale", fuse_into: drop, config: {{factor: 2}}}}
  collect: {{kind: "{N}:Collect"}}
edges: [numbers -> scale, scale -> drop, drop -> twice, twice -> collect]
schedule: {{steps: 12, batch_size: 4, max_staleness: 2, checkpoint_every: 4}}
supervision: {{heartbeat_s: 0.2, deadline_s: 3.0}}
"""


def expected_sums(steps: int, size: int) -> dict[str, int]:
    """scale x3, drop every index % 3 == 1, twice x2: what the sink must have seen per ticket."""
    return {f"t-{i:06d}": 6 * sum(range(i * size, (i + 1) * size)) for i in range(steps) if i % 3 != 1}


def check_run(result, steps: int) -> None:
    assert result.exit_code == 0, result.stderr[-3000:]
    audit = result.audit()
    assert audit.exactly_once, (audit.lost, audit.duplicated)
    assert len(audit.issued) == steps
    state = node_state(result.run_dir, "collect", step=steps)
    assert dict((bid, s) for bid, s in state["seen"]) == expected_sums(steps, 4)
    dropped = sorted(r["batch_id"] for r in result.ledger if r["event"] == "dropped")
    assert dropped == [f"t-{i:06d}" for i in range(steps) if i % 3 == 1]


SOURCE_FUSED = GRAPH.replace(f'"{N}:Numbers"}}', f'"{N}:Numbers", fuse_into: scale}}')
"""The source fused too: the scale's process takes the tickets and makes the numbers itself."""


@pytest.mark.parametrize("text, procs", [(GRAPH, ["collect", "numbers", "scale"]), (SOURCE_FUSED, ["collect", "scale"])],
                         ids=["after", "source-too"])
def test_a_fused_chain_runs_in_its_hosts_process_with_the_unfused_results(tmp_path, text, procs):
    (tmp_path / "g.yaml").write_text(text)
    result = run_graph(tmp_path / "g.yaml", tmp_path / "run", timeout_s=120)
    check_run(result, 12)
    assert sorted(p.name for p in (result.run_dir / "logs").glob("*.log")) == [f"{p}.0.0.log" for p in procs]
    assert not [r for r in result.ledger if r["event"] == "node_down"]  # no restarts in a fault-free run
    assert not any(k.startswith("channel_bytes/scale->drop") or "->twice" in k for r in result.metrics for k in r)


@pytest.mark.parametrize("text", [GRAPH, SOURCE_FUSED], ids=["after", "source-too"])
def test_a_killed_host_restarts_with_its_fused_nodes_and_replays_exactly_once(tmp_path, text):
    (tmp_path / "g.yaml").write_text(text.replace("factor: 3}}", "factor: 3, delay_s: 0.02}}"))
    result = run_graph(tmp_path / "g.yaml", tmp_path / "run", faults=["kill:scale@step=5"], timeout_s=150)
    check_run(result, 12)
    downs = [r for r in result.ledger if r["event"] == "node_down"]
    assert [r["node"] for r in downs] == ["scale/0/0"], downs


def test_a_fused_node_that_raises_is_its_hosts_failure_and_named_in_the_error(tmp_path):
    text = GRAPH.replace(f'"{N}:DropEvery", fuse_into: scale, config: {{every: 3, remainder: 1}}',
                         f'"{N}:Faulty", fuse_into: scale, config: {{fail_at: 2}}').replace(
        f'"{N}:Scale", config: {{factor: 3}}', f'"{N}:Scale", config: {{factor: 3}}, '
        'on_failure: {max_restarts: 1, backoff_s: 0}')
    (tmp_path / "g.yaml").write_text(text)
    result = run_graph(tmp_path / "g.yaml", tmp_path / "run", timeout_s=120)
    assert result.exit_code == 1, result.stderr[-3000:]
    assert "node 'scale'" in result.stderr and "a deterministic bug in the node" in result.stderr
    assert "KeyError: 'scores' (raised by node 'drop', fused into 'scale') at " in result.stderr


# the fused class alone, in this process ---------------------------------------------------------

def build(text: str, name: str):
    spec = load_graph_text(text)
    cls = node_class(spec.nodes[name])
    ctx = NodeContext(name=name, kind=spec.nodes[name].kind, replica=0, replicas=1, seed=0, device="cpu",
                      devices=[0], dtype="float32", graph=spec, log=logging.getLogger("t"))
    return cls, cls(cls.Config.model_validate(spec.nodes[name].config), ctx)


def test_a_fused_source_makes_the_batch_its_host_would_have_received():
    from flowrl.node import Ticket

    cls, node = build(SOURCE_FUSED, "scale")
    assert cls.inputs == () and node.fused_source[0] == "numbers"
    ticket = Ticket(batch_id="t-000003", index=3, attempt=1, min_policy_version=2, size=4, epoch=1)
    out = anyio.run(node.generate, ticket)["out"]
    assert out.tensors["x"].tolist() == [6 * x for x in range(12, 16)]
    assert (out.batch_id, out.attempt, out.index, out.min_version, out.epoch) == ("t-000003", 1, 3, 2, 1)
    assert isinstance(anyio.run(node.generate, Ticket(batch_id="t-000004", index=4, attempt=0, min_policy_version=0,
                                                      size=4))["out"], Drop)  # index 4 % 3 == 1


def test_the_fused_class_is_its_hosts_and_calls_the_chain_in_order():
    from flowrl.testing.nodes import Scale

    cls, node = build(GRAPH, "scale")
    assert issubclass(cls, Scale) and cls.__name__ == "Scale+drop+twice"
    assert [(n, p, type(f).__name__, f.ctx.name) for n, p, f in node.fused_nodes] == [
        ("drop", "out", "DropEvery", "drop"), ("twice", "out", "Scale", "twice")]

    async def main():
        await node.setup()
        kept = await node.process(Batch(tensors={"x": np.arange(4)}, meta={}, index=0), "in")
        gone = await node.process(Batch(tensors={"x": np.arange(4)}, meta={}, index=1), "in")
        return kept, gone

    kept, gone = anyio.run(main)
    assert kept["out"].tensors["x"].tolist() == [0, 6, 12, 18]
    assert isinstance(gone["out"], Drop) and "index 1" in gone["out"].reason


def test_a_fused_node_given_less_than_it_requires_or_returning_garbage_is_named():
    from flowrl.node import Ticket

    text = f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  advantages: {{kind: group_advantages, fuse_into: numbers}}
  collect: {{kind: "{N}:Collect"}}
edges: [numbers -> advantages, advantages -> collect]
"""
    _, node = build(text, "numbers")
    ticket = Ticket(batch_id="t-000000", index=0, attempt=0, min_policy_version=0, size=2)
    with pytest.raises(NodeContractError, match=r"node 'advantages' takes numbers.out in one process \(fused\): no tensor 'scores'"):
        anyio.run(node.generate, ticket)
    _, node = build(GRAPH.replace("DropEvery", "Faulty").replace("every: 3, remainder: 1", "bad_return: true"),
                    "scale")
    with pytest.raises(NodeContractError, match=r"node 'drop': process\(\) returned list"):
        anyio.run(node.process, Batch(tensors={"x": np.arange(4)}, meta={}, index=0), "in")


def test_a_fault_aimed_at_a_fused_node_is_refused_naming_its_host():
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "flowrl", "run", "graphs/grpo.yaml", "--dry-run",
                          "--fault", "kill:reward@step=2"], capture_output=True, text=True, timeout=60, cwd=root)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "'reward' runs inside the process of 'rollout' (fuse_into); fault 'rollout'" in out.stderr
    assert "nodes.reward.fuse_into=null" in out.stderr
