"""Graph files: typed loading with file/line errors, overrides, structural checks."""

from pathlib import Path

import pytest

from flowrl.graph import GraphError, GraphSpec, NodeSpec, dump_graph, load_graph, load_graph_text

ROOT = Path(__file__).resolve().parents[2]

PIPE = """\
name: t
nodes:
  prompts: {kind: prompts}
  rollout: {kind: rollout}
  actor: {kind: actor}
edges:
  - prompts -> rollout
  - rollout -> actor
weights:
  - actor -> rollout
"""


def problems(text, overrides=()):
    with pytest.raises(GraphError) as e:
        load_graph_text(text, "g.yaml", overrides)
    return e.value.problems


@pytest.mark.parametrize("path", sorted((ROOT / "graphs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_graph_loads(path):
    spec = load_graph(path)
    assert spec.nodes and spec.edges


def test_edge_strings_fill_default_ports():
    spec = load_graph_text(PIPE)
    assert [str(e) for e in spec.edges] == ["prompts.out -> rollout.in", "rollout.out -> actor.in"]
    assert str(spec.weights[0]) == "actor -> rollout"


def test_unknown_key_names_file_line_and_suggests_the_key():
    (p,) = problems(PIPE.replace("rollout: {kind: rollout}", "rollout: {kind: rollout, devics: 2}"))
    assert (p.file, p.line, p.path) == ("g.yaml", 4, "nodes.rollout.devics")
    assert "devices" in p.fix


def test_out_of_range_value_gives_the_value_and_the_limit():
    (p,) = problems(PIPE + "schedule: {steps: 0}\n")
    assert p.path == "schedule.steps" and "0" in p.message and ">= 1" in p.fix and p.line == 11


def test_unknown_kind_suggests_the_closest_builtin():
    (p,) = problems(PIPE.replace("kind: rollout", "kind: rolout"))
    assert p.path == "nodes.rollout.kind" and "rollout" in p.message and p.line == 4


def test_unknown_node_in_edge_is_reported_with_its_line():
    (p,) = problems(PIPE.replace("rollout -> actor", "rollout -> actr"))
    assert p.line == 8 and "actr" in p.message and "actor" in p.fix


def test_dangling_input_port_is_an_error():
    text = PIPE.replace("  - rollout -> actor\n", "")
    found = problems(text)
    assert any("rollout.out" in p.message and "dangling" in p.message for p in found)
    assert any("actor.in" in p.message for p in found)


def test_duplicate_node_names_are_an_error():
    (p,) = problems(PIPE.replace("  actor: {kind: actor}\n", "  actor: {kind: actor}\n  actor: {kind: actor}\n"))
    assert "twice" in p.message and p.line == 6


def test_data_cycle_is_an_error_but_a_weight_edge_back_is_not():
    text = """\
nodes:
  prompts: {kind: prompts}
  a: {kind: "tests.graph.kinds:TwoIn"}
  b: {kind: "tests.graph.kinds:Pass"}
edges:
  - prompts -> a.x
  - a -> b
  - b -> a.y
"""
    found = problems(text)
    assert any("cycle" in p.message and "a -> b -> a" in p.message for p in found)
    load_graph_text(PIPE)  # actor -> rollout only as a weight edge: fine


def test_port_that_does_not_exist_lists_the_real_ports():
    text = PIPE.replace("rollout -> actor", "rollout.outt -> actor")
    (p,) = problems(text)
    assert "outt" in p.message and "out" in p.fix


def test_weight_edge_must_go_from_a_publisher_to_a_subscriber():
    found = problems(PIPE.replace("actor -> rollout", "rollout -> actor"))
    assert [p.path for p in found] == ["weights.0", "weights.0"]
    assert "does not publish" in found[0].message and "does not take weights" in found[1].message


def test_overrides_are_validated_like_the_file():
    spec = load_graph_text(PIPE, "g.yaml", ["schedule.steps=7", "nodes.rollout.replicas=2"])
    assert spec.schedule.steps == 7 and spec.nodes["rollout"].replicas == 2
    (p,) = problems(PIPE, ["schedule.stepz=7"])
    assert "override" in p.file and "steps" in p.fix


def test_yaml_syntax_error_names_the_line():
    (p,) = problems("nodes:\n  a: [1, 2\n  b: 3\n")
    assert p.line is not None and "YAML" in p.message


def test_graph_built_in_python_equals_the_file_and_dumps_back():
    built = GraphSpec(
        name="t",
        nodes={"prompts": NodeSpec(kind="prompts"), "rollout": NodeSpec(kind="rollout"), "actor": NodeSpec(kind="actor")},
        edges=["prompts -> rollout", "rollout -> actor"],
        weights=["actor -> rollout"],
    )
    loaded = load_graph_text(PIPE)
    from flowrl.graph import check_structure

    check_structure(built)
    assert built.model_dump() == loaded.model_dump()
    again = load_graph_text(dump_graph(loaded))
    assert again.model_dump() == loaded.model_dump()


def test_vars_override_reaches_every_alias_but_a_node_override_only_that_node():
    text = """\
vars:
  model: &m {d: 1}
nodes:
  prompts: {kind: prompts}
  rollout: {kind: "tests.graph.kinds:Pass", config: {}}
  actor: {kind: actor}
edges: [prompts -> rollout, rollout -> actor]
"""
    from flowrl.graph.loader import apply_overrides, parse_yaml

    located = parse_yaml(text.replace("config: {}", "config: {m: *m}") + "other: {m: *m}\n")
    apply_overrides(located, ["vars.model.d=2"])
    assert located.data["other"]["m"]["d"] == 2 and located.data["nodes"]["rollout"]["config"]["m"]["d"] == 2
    apply_overrides(located, ["other.m.d=3"])
    assert located.data["other"]["m"]["d"] == 3 and located.data["nodes"]["rollout"]["config"]["m"]["d"] == 2
