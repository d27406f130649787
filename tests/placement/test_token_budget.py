"""`token-budget`: a packing node's budget against the longest sequence the graph allows, and the
memory model sizing activations by that budget."""

from flowrl.graph import load_graph
from flowrl.placement import make_plan
from flowrl.placement.declared import DeclaredInventory
from flowrl.placement.memory import node_need
from flowrl.placement.rules_memory import model_shape

INV = DeclaredInventory.from_text("""
hosts:
  - {name: h, gpu_defaults: {memory_gb: 80, compute_capability: "9.0"}, gpus: [{id: 0}, {id: 1}, {id: 2}, {id: 3}]}
""")


def plan(tmp_path, actor_train: str, dataset: str = "", ref: str = ""):
    text = f"""
name: t
vars:
  model: &model {{type: tiny, max_seq_len: 128}}
nodes:
  prompts: {{kind: prompts{dataset}}}
  rollout: {{kind: rollout, devices: 1, config: {{model: *model, max_new_tokens: 24}}}}
  reference: {{kind: reference, devices: 1, config: {{model: *model{ref}}}}}
  reward: {{kind: reward}}
  advantages: {{kind: group_advantages}}
  actor: {{kind: actor, devices: 1, config: {{model: *model, train: {{{actor_train}}}}}}}
edges: [prompts -> rollout, rollout -> reward, reward -> reference, reference -> advantages, advantages -> actor]
weights: [actor -> rollout]
"""
    path = tmp_path / "g.yaml"
    path.write_text(text)
    return make_plan(load_graph(path), INV)


def findings(p):
    return [(f.code, f.node) for f in p.findings if f.code == "token-budget"]


def test_a_budget_below_the_models_context_is_a_warning_naming_node_key_and_fix(tmp_path):
    p = plan(tmp_path, "max_tokens_per_microbatch: 64", ref=", max_tokens_per_microbatch: 100")
    assert sorted(findings(p)) == [("token-budget", "actor"), ("token-budget", "reference")]
    actor = next(f for f in p.findings if f.node == "actor" and f.code == "token-budget")
    assert "train.max_tokens_per_microbatch: 128 or more" in actor.message and actor.severity == "warning"


def test_defaults_and_large_budgets_are_quiet(tmp_path):
    assert findings(plan(tmp_path, "lr: 0.001")) == []  # the default budget (4096) holds any 128 tokens
    assert findings(plan(tmp_path, "max_tokens_per_microbatch: 128")) == []


def test_the_memory_model_sizes_activations_by_the_nodes_budget(tmp_path):
    p = plan(tmp_path, "max_tokens_per_microbatch: 8192")
    graph = load_graph(tmp_path / "g.yaml")
    shape = model_shape(graph.nodes["actor"], None)
    small = node_need(shape, role="actor", dtype="float32", ranks=1, card_bytes=80 << 30, tokens=1024)
    big = node_need(shape, role="actor", dtype="float32", ranks=1, card_bytes=80 << 30, tokens=8192)
    assert big.parts["activations"] == 8 * small.parts["activations"]
    assert p.ok, p.errors
