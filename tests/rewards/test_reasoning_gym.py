"""reasoning-gym as a source (generated offline) and its checker as a reward term."""

import pytest

from flowrl.data import decode_answers
from flowrl.nodes.dataset import Dataset
from flowrl.rewards import Inputs, parse_terms, score_terms
from flowrl.runtime.node import Ticket
from tests.node_harness import call, make_node

rg = pytest.importorskip("reasoning_gym")


def test_generated_items_flow_through_the_dataset_node_and_are_scored_by_their_checker():
    node = make_node(Dataset, {"path": "basic_arithmetic", "format": "reasoning_gym", "answer_field": "entry",
                               "options": {"size": 20, "seed": 3}, "model": {"type": "tiny", "vocab_size": 102}})
    batch = call(node.generate, Ticket(batch_id="t-0", index=0, attempt=0, min_policy_version=0, size=4))
    refs = decode_answers(batch.tensors["targets"])
    rows = [node.rows[i] for i in batch.tensors["rows"].tolist()]
    right = [f"so <answer>{r['answer']}</answer>" for r in rows]
    wrong = ["<answer>not a number</answer>"] * 4
    specs = parse_terms([{"type": "reasoning_gym"}])
    assert score_terms(specs, Inputs(right, refs, [1] * 4, 8))[1] == [1.0] * 4
    assert score_terms(specs, Inputs(wrong, refs, [1] * 4, 8))[1] == [0.0] * 4


def test_a_plain_reference_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="answer_field: entry"):
        score_terms(parse_terms([{"type": "reasoning_gym"}]), Inputs(["1"], ["1"], [1], 4))
