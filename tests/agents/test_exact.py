"""The token-exactness check (flowrl/agents/exact.py) against the engine's own record."""

from __future__ import annotations

from flowrl.agents.exact import check, model_turns

SERVED = [{"session": "s", "prompt": [1, 2], "tokens": [5, 6, 13]},
          {"session": "s", "prompt": [1, 2, 5, 6, 13, 9], "tokens": [7, 13]},
          {"session": "s", "prompt": [1, 2, 5, 6, 13, 9], "tokens": [7, 13]}]  # a retried request


def test_a_trajectory_made_of_the_engines_turns_and_the_formats_tokens_passes():
    report = check([{"session": "s", "tokens": [1, 2, 5, 6, 13, 9, 7, 13], "mask": [0, 0, 1, 1, 1, 0, 1, 1]}], SERVED)
    assert report.ok and report.turns == 2


def test_two_turns_with_nothing_between_them_are_told_apart():
    served = [{"session": "s", "prompt": [1], "tokens": [5, 13]}, {"session": "s", "prompt": [1, 5, 13], "tokens": [6, 13]}]
    assert check([{"session": "s", "tokens": [1, 5, 13, 6, 13], "mask": [0, 1, 1, 1, 1]}], served).ok


def test_a_turn_encoded_again_from_its_text_fails():
    # the engine made [5, 6, 13]; a client that kept the text and encoded it got one merged id (56)
    report = check([{"session": "s", "tokens": [1, 2, 56, 13, 9, 7, 13], "mask": [0, 0, 1, 1, 0, 1, 1]}], SERVED)
    assert not report.ok
    assert "a turn must be trained on as generated" in report.problems[0]


def test_a_prefix_rendered_again_before_a_later_turn_fails():
    # the trained conversation is the generated one, but the engine was asked with a re-rendered prefix
    served = [{"session": "s", "prompt": [1, 2], "tokens": [5, 6, 13]},
              {"session": "s", "prompt": [1, 2, 56, 13, 9], "tokens": [7, 13]}]
    report = check([{"session": "s", "tokens": [1, 2, 5, 6, 13, 9, 7, 13], "mask": [0, 0, 1, 1, 1, 0, 1, 1]}], served)
    assert "re-tokenized between the engine and the trainer" in report.problems[0]


def test_a_mask_that_misses_or_adds_a_model_token_fails():
    short = check([{"session": "s", "tokens": [1, 2, 5, 6, 13, 9, 7, 13], "mask": [0, 0, 1, 1, 0, 0, 1, 1]}], SERVED)
    assert "must cover exactly the model's tokens" in short.problems[0]
    extra = check([{"session": "s", "tokens": [1, 2, 5, 6, 13, 9, 7, 13], "mask": [0, 1, 1, 1, 1, 0, 1, 1]}], SERVED)
    assert not extra.ok


def test_model_turns_are_the_runs_of_the_mask():
    assert model_turns([False, True, True, False, True]) == [(1, 3), (4, 5)]
    assert model_turns([]) == []
