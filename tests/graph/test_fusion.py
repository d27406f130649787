"""`fuse_into`: the graph check folds a light node into its host's process, or says which rule it
breaks (flowrl/graph/fusion.py). The runtime side is tests/runtime/test_fusion.py."""

from pathlib import Path

import pytest

from flowrl.graph import GraphError, dump_graph, load_graph, load_graph_text

ROOT = Path(__file__).resolve().parents[2]
GRPO = ROOT / "graphs" / "grpo.yaml"
N = "flowrl.testing.nodes"
UNFUSED = [f"nodes.{n}.fuse_into=null" for n in ("prompts", "reward", "reference", "advantages")]

CHAIN = f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  scale: {{kind: "{N}:Scale", fuse_into: numbers, config: {{factor: 3}}}}
  drop: {{kind: "{N}:DropEvery", fuse_into: scale}}
  collect: {{kind: "{N}:Collect"}}
edges: [numbers -> scale, scale -> drop, drop -> collect]
"""


def problems(text: str, overrides=()) -> list:
    with pytest.raises(GraphError) as e:
        load_graph_text(text, "g.yaml", overrides)
    return e.value.problems


def test_grpo_runs_every_node_but_the_actor_inside_the_rollouts_process():
    spec = load_graph(GRPO)
    assert list(spec.nodes) == ["rollout", "actor"]
    assert [str(e) for e in spec.edges] == ["rollout.out -> actor.in"]
    fused = spec.nodes["rollout"].fused
    assert list(fused) == ["prompts", "reward", "reference", "advantages"]  # the order of the calls
    assert fused["prompts"].fuse_into == "rollout.in"  # a source: before the rollout's call
    assert {fused[n].fuse_into for n in ("reward", "reference", "advantages")} == {"rollout.out"}
    assert fused["reward"].config == {"task": {"name": "reverse", "digits": 6}}
    unfused = load_graph(GRPO, UNFUSED)
    assert list(unfused.nodes) == ["prompts", "rollout", "reward", "reference", "advantages", "actor"]
    assert not any(n.fused for n in unfused.nodes.values())
    own_reference = load_graph(GRPO, ["nodes.reference.fuse_into=null"])
    assert list(own_reference.nodes) == ["rollout", "reference", "actor"]
    assert list(own_reference.nodes["reference"].fused) == ["advantages"]


def test_a_fused_graph_written_to_the_run_directory_loads_back_the_same():
    spec = load_graph(GRPO)
    again = load_graph_text(dump_graph(spec), "graph.yaml")  # a resume checks it again: nothing left to fold
    assert again.nodes == spec.nodes
    assert [str(e) for e in again.edges] == [str(e) for e in spec.edges]
    bad = dump_graph(spec).replace("kind: group_advantages", "kind: group_advantage")
    (p,) = problems(bad)
    assert p.path == "nodes.rollout.fused.advantages.kind" and "did you mean `group_advantages`" in p.message


def test_a_chain_folds_into_its_first_host_in_order():
    spec = load_graph_text(CHAIN)
    assert list(spec.nodes) == ["numbers", "collect"]
    assert [str(e) for e in spec.edges] == ["numbers.out -> collect.in"]
    assert list(spec.nodes["numbers"].fused) == ["scale", "drop"]
    assert {f.fuse_into for f in spec.nodes["numbers"].fused.values()} == {"numbers.out"}


@pytest.mark.parametrize("overrides, path, says", [
    (["nodes.actor.fuse_into=advantages"], "nodes.actor.fuse_into", "'actor' (actor) is stateful"),
    (["nodes.reward.fuse_into=rollot"], "nodes.reward.fuse_into", "did you mean 'rollout'?"),
    (["nodes.reward.fuse_into=reward"], "nodes.reward.fuse_into", "is fused into itself"),
    (["nodes.reward.fuse_into=prompts"], "nodes.reward.fuse_into", "its input edges are [rollout.out -> reward.in]"),
    (["nodes.reward.replicas=2"], "nodes.reward.replicas", "sets replicas; a fused node runs on its host's"),
    (["nodes.reward.on_failure.max_restarts=9"], "nodes.reward.on_failure", "sets on_failure"),
    (["nodes.rollout.fuse_into=prompts"], "nodes.rollout.fuse_into", "takes part in weight sync"),
    (["nodes.reward.fuse_into=rollout.out2"], "nodes.reward.fuse_into", "names port 'out2'"),
], ids=["stateful", "unknown", "itself", "not-its-input", "placement", "failure-policy", "weights", "port"])
def test_what_cannot_be_fused_is_refused_with_where_and_how_to_fix(overrides, path, says):
    found = problems(GRPO.read_text(), overrides)
    assert any(p.path == path and says in f"{p.message} {p.fix}" and p.fix for p in found), [str(p) for p in found]
    assert all(p.file == "g.yaml" for p in found)


def test_a_source_fuses_into_its_only_consumer_which_becomes_the_source():
    from flowrl.graph import node_classes
    from flowrl.graph.shapes import is_source

    spec = load_graph_text(CHAIN.replace('"{N}:Numbers"}}'.format(N=N), f'"{N}:Numbers", fuse_into: scale}}')
                           .replace("fuse_into: numbers, ", ""))
    assert list(spec.nodes) == ["scale", "collect"] and [str(e) for e in spec.edges] == ["scale.out -> collect.in"]
    assert list(spec.nodes["scale"].fused) == ["numbers", "drop"]
    cls = node_classes(spec)["scale"]
    assert is_source(cls) and cls.inputs == () and cls.outputs == ("out",)
    found = problems(GRPO.read_text(), ["nodes.prompts.fuse_into=reward"])
    assert any("its output edges are [prompts.out -> rollout.in]" in p.message for p in found), found
    found = problems(GRPO.read_text(), ["nodes.prompts.fuse_into=rollout.out"])
    assert any("names port 'out' but it feeds rollout.in" in p.message for p in found), found
    assert load_graph(GRPO, ["nodes.prompts.fuse_into=rollout.in"]).nodes["rollout"].fused["prompts"].fuse_into == "rollout.in"
    text = f"""\
nodes:
  numbers: {{kind: "{N}:Numbers", fuse_into: collect}}
  collect: {{kind: "{N}:Collect"}}
edges: [numbers -> collect]
"""
    (p,) = problems(text)
    assert "which is stateful; a source runs inside a stateless node with one input" in p.message


def test_a_port_that_also_feeds_another_node_is_not_fused():
    text = CHAIN.replace("fuse_into: scale", "").replace("edges: [", "edges: [numbers -> drop, ").replace(
        "drop -> collect", "drop -> collect, scale -> collect2").replace(
        "  collect: {", f'  collect2: {{kind: "{N}:Logger"}}\n  collect: {{')
    (p,) = problems(text.replace("scale -> drop, ", ""))
    assert p.path == "nodes.scale.fuse_into" and "also feeds numbers.out -> drop.in" in p.message
    assert p.line == 3  # the fused node's line in the file


def test_a_host_with_several_ranks_and_a_join_are_refused():
    ranks = CHAIN.replace('"{N}:Numbers"}}'.format(N=N), f'"{N}:Numbers", devices: 2}}')
    assert any("runs 2 ranks per replica" in p.message for p in problems(ranks))
    join = f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  left: {{kind: "{N}:Scale"}}
  pair: {{kind: "{N}:Pair", fuse_into: left}}
  collect: {{kind: "{N}:Collect"}}
edges: [numbers -> left, left -> pair.a, numbers -> pair.b, pair -> collect]
"""
    assert any("input ports ['a', 'b']" in p.message for p in problems(join))


def test_check_notes_which_nodes_run_in_which_process():
    from flowrl.placement import get_inventory, make_plan

    plan = make_plan(load_graph(GRPO), get_inventory(None))
    notes = {f.node: f for f in plan.findings if f.code == "fused"}
    assert set(notes) == {"rollout"} and notes["rollout"].severity == "info"
    assert "prompts, reward, reference, advantages run inside `rollout`'s process" in notes["rollout"].message
    assert {e.node for e in plan.entries} == {"rollout", "actor"}


def test_a_fused_reference_counts_on_its_hosts_gpus():
    from flowrl.placement import make_plan
    from flowrl.placement.declared import DeclaredInventory

    a100 = DeclaredInventory.load(ROOT / "examples" / "inventories" / "a100x8-nvlink.yaml")
    big = ["vars.model.d_model=4096", "vars.model.n_layers=24", "nodes.rollout.devices=[0]"]
    apart = make_plan(load_graph(GRPO, big + ["nodes.reference.fuse_into=null"]), a100)
    fused = make_plan(load_graph(GRPO, big), a100)
    rollout_gpu = lambda plan: next(r for r in plan.memory if r["devices"] == [0])  # noqa: E731
    reference = next(r for r in apart.memory if "reference" in r["text"])
    assert rollout_gpu(fused)["bytes"] == rollout_gpu(apart)["bytes"] + reference["bytes"] > 4 << 30
    (note,) = [f for f in fused.findings if f.code == "fused" and f.node == "rollout"]
    assert note.severity == "info" and "prompts, reward, reference, advantages run inside" in note.message
