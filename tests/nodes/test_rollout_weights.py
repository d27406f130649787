"""What a rollout hands the runtime to receive versions into: a builtin engine's module, swapped
whole (no copy a version), unless the rollout shares its devices (`colocate_with`): then the
engine's tensors, copied into (a handoff reads the trainer's region as staging, and a sleep
between turns offloads the module's own tensors)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowrl.graph import load_graph
from flowrl.models import build_model
from flowrl.nodes.rollout import Rollout
from flowrl.weights import WeightSubscriber
from tests.node_harness import make_node

pytestmark = pytest.mark.timeout(60)

GRAPH = Path(__file__).resolve().parents[2] / "graphs" / "grpo.yaml"


def rollout(graph):
    spec = graph.nodes["rollout"]
    return make_node(Rollout, spec.config, name="rollout", graph=graph)


def test_a_rollout_on_devices_of_its_own_takes_each_version_by_a_swap_not_a_copy():
    node = rollout(load_graph(GRAPH))
    target = node.weights()
    assert isinstance(target, torch.nn.Module) and target is node.engine.model
    sub = WeightSubscriber(target)
    assert sub.mode == "swap"
    new = build_model(node.config.model, seed=7).state_dict()
    sub.plan.pack(new, out=sub.staging)  # what a broadcast writes
    staging = {b.data_ptr() for b in sub.staging}
    sub.commit(1)
    node.load_weights(sub.received(), 1)
    for name, tensor in node.engine.model.state_dict().items():
        assert torch.equal(tensor, new[name]), name
        assert tensor.untyped_storage().data_ptr() in staging, f"{name} was copied, not swapped in"
    assert node.engine.version == 1


def test_a_colocated_rollout_keeps_its_own_tensors_and_takes_versions_by_a_copy():
    graph = load_graph(GRAPH)
    nodes = dict(graph.nodes)
    nodes["rollout"] = nodes["rollout"].model_copy(update={"colocate_with": ["actor"]})
    node = rollout(graph.model_copy(update={"nodes": nodes}))
    target = node.weights()
    assert isinstance(target, dict) and WeightSubscriber(target).mode == "copy"
    model = node.engine.model
    assert all(t.data_ptr() == p.data_ptr() for t, p in zip(target.values(), model.state_dict().values()))
    alone = make_node(Rollout, load_graph(GRAPH).nodes["rollout"].config, name="rollout")  # no graph: the tensors
    assert isinstance(alone.weights(), dict)
