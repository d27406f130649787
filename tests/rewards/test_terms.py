"""Reward terms from configuration, and the `rewards` node that applies them to a rollout batch."""

import json

import pytest
import torch

import flowrl
from flowrl.data import CharTokenizer, encode_answers
from flowrl.nodes.rewards import Rewards
from flowrl.rewards import (
    Inputs,
    format_scores,
    overlong_penalty,
    parse_terms,
    score_terms,
)
from flowrl.rewards.code import code_scores
from flowrl.rewards.passk import pass_at_k
from flowrl.rewards.sandbox import Limits
from flowrl.tasks import EOS, PAD
from tests.node_harness import call, make_node, metrics_row


def test_format_regex_and_the_dapo_overlong_penalty():
    assert format_scores([" 42 ", "42 apples", "x"], r"\d+") == [1.0, 0.0, 0.0]
    assert format_scores(["42 apples"], r"\d+", mode="match") == [1.0]
    assert overlong_penalty([1, 12, 13, 14, 16], max_tokens=16, buffer=4) == [0.0, 0.0, -0.25, -0.5, -1.0]
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty([1], max_tokens=4, buffer=8)


def test_code_answers_pass_the_tests_they_pass():
    tests = json.dumps([{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4\n", "output": "6"}])
    right = "Here:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    half = "```python\na, b = map(int, input().split())\nprint(5)\n```"
    loops = "```python\nwhile True: pass\n```"
    apps = json.dumps({"inputs": ["2 3\n"], "outputs": ["5\n"]})
    got = code_scores([right, half, loops, right], [tests, tests, apps, apps], Limits(cpu_s=1))
    assert got == [1.0, 0.5, 0.0, 1.0]


def test_weighted_terms_add_up_and_are_reported_by_name():
    specs = parse_terms([{"type": "math"}, {"type": "format", "pattern": r"\d+", "weight": 0.5},
                         {"type": "length", "buffer": 2, "weight": 1.0}])
    per, total = score_terms(specs, Inputs(["12", "so 12", "13"], ["12"] * 3, [3, 4, 4], max_tokens=4))
    assert per == {"math": [1.0, 1.0, 0.0], "format": [1.0, 0.0, 1.0], "length": [-0.5, -1.0, -1.0]}
    assert total == [1.0, 0.0, -0.5]
    with pytest.raises(Exception, match="pattern"):
        parse_terms([{"type": "format"}])


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 1, 1) == 0.25 and pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)


def _rollout_batch(responses: list[str], answers: list[str], width: int = 4):
    """What the rollout emits from a dataset batch: prompt + response tokens, EOS then PAD."""
    tok = CharTokenizer()
    prompt = tok.encode("Q=")
    rows, masks = [], []
    for r in responses:
        ids = [t for t in tok.encode(r)[1:]][: width - 1] + [EOS]
        rows.append(prompt + ids + [PAD] * (width - len(ids)))
        masks.append([True] * len(ids) + [False] * (width - len(ids)))
    return flowrl.Batch(tensors={"tokens": torch.tensor(rows), "response_mask": torch.tensor(masks),
                                 "targets": torch.from_numpy(encode_answers(answers))},
                        meta={"samples_per_prompt": 2, "max_new_tokens": width, "targets_encoding": "utf8",
                              "tokenizer": {"type": "char"}})


def test_the_rewards_node_scores_decoded_responses_and_reports_each_term(tmp_path):
    node = make_node(Rewards, {"terms": [{"type": "math"}, {"type": "format", "pattern": r"\d", "weight": 0.25}]},
                     name="rewards")
    out = call(node.process, _rollout_batch(["7", "x7", "3", "ab"], ["7", "7", "4", "4"]), "in")
    assert out.tensors["scores"].tolist() == [1.25, 1.0, 0.25, 0.0]
    row = metrics_row(node, tmp_path)
    assert row["reward_math_mean"] == 0.5 and row["reward_format_mean"] == 0.5


def test_the_rewards_node_refuses_batches_of_token_id_targets():
    node = make_node(Rewards, {"terms": [{"type": "math"}]})
    batch = _rollout_batch(["7"], ["7"])
    batch = batch.replace(meta={k: v for k, v in batch.meta.items() if k != "targets_encoding"})
    with pytest.raises(ValueError, match="for the built-in digit tasks use `kind: reward`"):
        call(node.process, batch, "in")
