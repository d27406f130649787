"""The evaluator observer, called as the runtime will: weights loaded in place, then observe(version)."""

import json

import pytest
import torch

from flowrl.nodes.evaluator import Evaluator
from tests.node_harness import call, make_node, metrics_row

MODEL = {"type": "tiny", "vocab_size": 102, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 32}


def always_says_seven(model):
    """Weights whose every position predicts the digit 7 (token 7) with near certainty."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["norm.weight"].zero_()
    state["norm.bias"].zero_()
    state["norm.bias"][0] = 1.0  # the final hidden state is e0 everywhere
    state["lm_head.weight"].fill_(0.0)
    state["lm_head.weight"][:, 0] = -20.0
    state["lm_head.weight"][7, 0] = 20.0
    return state


@pytest.fixture
def heldout(tmp_path):
    path = tmp_path / "test.jsonl"
    rows = [{"question": f"{a}+{b}", "answer": str(a + b)} for a, b in [(3, 4), (5, 2), (1, 1), (2, 2)]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_every_nth_version_scores_greedy_and_pass_at_k_into_eval_metrics(heldout, tmp_path):
    node = make_node(Evaluator, {"path": str(heldout), "template": "{question}=", "model": MODEL, "max_new_tokens": 1,
                                 "every_versions": 5, "samples": 4, "batch_prompts": 3}, name="eval")
    assert (Evaluator.inputs, Evaluator.outputs, Evaluator.subscribes_weights) == ((), (), True)
    live = node.weights()
    with torch.no_grad():  # what the runtime's weight sync does: the new version lands in place
        for k, v in always_says_seven(node.model).items():
            live[k].copy_(v)
    node.load_weights(live, 5)

    assert call(node.observe, 3) is None  # not a multiple of every_versions: nothing runs
    result = call(node.observe, 5)
    assert result["reward_greedy"] == 0.5 and result["pass@1"] == 0.5 and result["pass@4"] == 0.5
    assert result["reward_sampled"] == 0.5 and result["version"] == 5
    # a sync may hand over a newer version than the multiple it was ordered for: 11 stands for 10
    assert call(node.observe, 9) is None and call(node.observe, 11)["version"] == 11
    assert call(node.observe, 12) is None and call(node.observe, 11) is None
    row = metrics_row(node, tmp_path)
    assert row["eval/reward_greedy"] == 0.5 and row["eval/pass@4"] == 0.5 and row["eval/version"] == 11


def test_an_untrained_model_scores_near_zero_and_the_limit_caps_the_set(heldout, tmp_path):
    node = make_node(Evaluator, {"path": str(heldout), "template": "{question}=", "model": MODEL, "max_new_tokens": 2,
                                 "every_versions": 1, "samples": 2, "limit": 2}, name="eval")
    result = call(node.observe, 1)
    assert len(node.prompts) == 2 and 0.0 <= result["reward_greedy"] <= 0.5 and "pass@2" in result
