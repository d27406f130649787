"""The built-in tasks: pure prompt streams, correct answers, partial-credit scores in [0, 1]."""

from __future__ import annotations

import pytest
import torch

from flowrl.tasks import (
    ADD, BOS, EOS, PAD, PLUS, REV, SEP, SORT, VOCAB_SIZE, build_task, decode, encode, parse_task_spec,
)
from flowrl.tasks.base import partial_credit, seeded_digits


def _answer(targets: torch.Tensor, pad_to: int) -> torch.Tensor:
    """Targets + EOS, then PAD up to ``pad_to`` tokens: what a perfect policy generates."""
    n = targets.shape[0]
    out = torch.full((n, pad_to), PAD)
    out[:, : targets.shape[1]] = targets
    out[:, targets.shape[1]] = EOS
    return out


def test_prompts_are_a_pure_function_of_seed_and_index_whatever_the_batch_size():
    task = build_task({"name": "reverse", "digits": 5})
    whole, whole_t = task.prompts(seed=7, index=10, n=8)
    for i in range(8):
        one, one_t = task.prompts(seed=7, index=10 + i, n=1)
        assert torch.equal(one[0], whole[i]) and torch.equal(one_t[0], whole_t[i])
    again, _ = task.prompts(seed=7, index=10, n=8)
    assert torch.equal(again, whole)
    other, _ = task.prompts(seed=8, index=10, n=8)
    assert not torch.equal(other, whole)


def test_seeded_digits_cover_all_ten_digits_evenly():
    digits = seeded_digits(seed=3, index=0, n=2000, length=6)
    counts = torch.bincount(torch.from_numpy(digits).flatten(), minlength=10)
    assert counts.shape == (10,) and int(counts.min()) > 1000  # 1200 expected per digit


def test_reverse_prompt_layout_and_answer():
    task = build_task({"name": "reverse", "digits": 4})
    prompts, targets = task.prompts(0, 0, 3)
    assert prompts.shape == (3, task.prompt_len) == (3, 7) and prompts.dtype == torch.int64
    assert targets.shape == (3, task.answer_len) == (3, 4)
    assert (prompts[:, 0] == BOS).all() and (prompts[:, 1] == REV).all() and (prompts[:, -1] == SEP).all()
    assert torch.equal(targets, prompts[:, 2:6].flip(1))
    assert task.max_new_tokens == 5


def test_sort_answer_is_the_prompt_digits_ascending():
    task = build_task({"name": "sort", "digits": 6})
    prompts, targets = task.prompts(1, 0, 50)
    assert (prompts[:, 1] == SORT).all()
    assert torch.equal(targets, prompts[:, 2:8].sort(dim=1).values)


@pytest.mark.parametrize("reverse_answer", [True, False])
def test_addition_answer_is_the_sum_with_its_carry_digit(reverse_answer):
    task = build_task({"name": "add", "digits": 3, "reverse_answer": reverse_answer})
    prompts, targets = task.prompts(2, 0, 200)
    assert task.prompt_len == 10 and task.answer_len == 4
    assert (prompts[:, 1] == ADD).all() and (prompts[:, 5] == PLUS).all()
    for row, target in zip(prompts.tolist(), targets.tolist()):
        a = int("".join(map(str, row[2:5])))
        b = int("".join(map(str, row[6:9])))
        want = f"{a + b:04d}"
        assert "".join(map(str, target)) == (want[::-1] if reverse_answer else want)


def test_addition_of_many_digits_does_not_overflow():
    task = build_task({"name": "add", "digits": 32, "reverse_answer": False})
    prompts, targets = task.prompts(0, 0, 4)
    for row, target in zip(prompts.tolist(), targets.tolist()):
        a, b = int("".join(map(str, row[2:34]))), int("".join(map(str, row[35:67])))
        assert "".join(map(str, target)) == f"{a + b:033d}"


@pytest.mark.parametrize("name", ["reverse", "sort", "add"])
def test_the_exact_answer_scores_one_and_every_token_is_in_the_vocabulary(name):
    task = build_task({"name": name, "digits": 4})
    prompts, targets = task.prompts(0, 0, 16)
    assert int(prompts.max()) < VOCAB_SIZE and int(prompts.min()) >= 0
    scores = task.score(_answer(targets, task.max_new_tokens), targets)
    assert torch.equal(scores, torch.ones(16))


def _score(response: str, target: str) -> float:
    return float(partial_credit(torch.tensor([encode(response)]), torch.tensor([encode(target)]))[0])


def test_partial_credit_counts_matching_positions_over_the_longer_length():
    assert _score("4321$", "4321") == 1.0
    assert _score("4301$", "4321") == pytest.approx(4 / 5)  # one wrong digit
    assert _score("43$__", "4321") == pytest.approx(2 / 5)  # stopped early
    assert _score("43215$", "4321") == pytest.approx(4 / 6)  # one digit too many
    assert _score("43210", "4321") == pytest.approx(4 / 5)  # no EOS within the budget
    assert _score("$____", "4321") == 0.0  # EOS right away
    assert _score("1234$", "4321") == pytest.approx(1 / 5)  # only the EOS is right


def test_partial_credit_ignores_everything_after_the_first_eos():
    assert _score("43$21", "4321") == pytest.approx(2 / 5)
    assert _score("4321$4321$", "4321") == 1.0


def test_partial_credit_with_a_response_shorter_than_the_answer():
    assert _score("43", "4321") == pytest.approx(2 / 5)


def test_scores_stay_in_the_unit_interval_for_random_responses():
    task = build_task({"name": "sort", "digits": 5})
    _, targets = task.prompts(0, 0, 500)
    responses = torch.randint(0, VOCAB_SIZE, (500, 9), generator=torch.Generator().manual_seed(0))
    scores = task.score(responses, targets)
    assert scores.shape == (500,) and float(scores.min()) >= 0.0 and float(scores.max()) <= 1.0
    assert 0.02 < float(scores.mean()) < 0.15  # about chance: 1 / VOCAB_SIZE per position


def test_score_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="same n"):
        partial_credit(torch.zeros(3, 5, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))


def test_unknown_task_names_and_keys_are_rejected_with_the_choices():
    with pytest.raises(ValueError, match="reverse, sort, add"):
        parse_task_spec({"name": "reversal"})
    with pytest.raises(ValueError, match="digitz"):
        parse_task_spec({"name": "reverse", "digitz": 4})
    with pytest.raises(ValueError, match="seed must be"):
        build_task({"name": "reverse"}).prompts(-1, 0, 2)


def test_vocabulary_round_trips_and_rejects_unknown_characters():
    assert decode(encode("^R1234=4321$_")) == "^R1234=4321$_"
    with pytest.raises(ValueError, match="not in the task vocabulary"):
        encode("12x")


def test_task_specs_import_without_torch():
    import subprocess
    import sys

    code = "import sys, flowrl.tasks, flowrl.models, flowrl.rl; from flowrl.tasks import *; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


# The long-tail task: answers of widely varying length, PAD-padded targets.


def test_longtail_lengths_are_long_tailed_and_reach_the_clip():
    task = build_task({"name": "longtail"})  # median 8, sigma 1.2, max_len 200
    lengths = torch.from_numpy(task.lengths(seed=0, index=0, n=20_000)).double()
    assert int(lengths.min()) == 1 and int(lengths.max()) == 200
    median, p90, p99 = (float(lengths.quantile(q)) for q in (0.5, 0.9, 0.99))
    assert 7 <= median <= 9 and 30 <= p90 <= 45 and 100 <= p99 <= 170
    assert float(lengths.mean()) > 1.8 * median  # the tail pulls the mean far above the median
    assert 0.001 < float((lengths == 200).double().mean()) < 0.01


def test_longtail_prompt_says_the_count_and_the_target_counts_to_it():
    task = build_task({"name": "longtail", "max_len": 200})
    prompts, targets = task.prompts(seed=3, index=0, n=500)
    assert prompts.shape == (500, task.prompt_len) == (500, 5) and targets.shape == (500, 200)
    assert task.max_new_tokens == 201
    assert (prompts[:, 0] == BOS).all() and (prompts[:, -1] == SEP).all()
    lengths = task.lengths(3, 0, 500)
    for row, target, n in zip(prompts.tolist(), targets.tolist(), lengths.tolist()):
        assert int("".join(map(str, row[1:4]))) == n
        assert target == [i % 10 for i in range(1, n + 1)] + [PAD] * (200 - n)
    assert decode(task.prompts(0, 0, 1)[0][0]) == "^003="


def test_longtail_repeat_prompt_says_the_digit_and_the_count_and_the_target_repeats_it():
    task = build_task({"name": "longtail", "answer": "repeat", "max_len": 50})
    prompts, targets = task.prompts(seed=3, index=0, n=500)
    assert prompts.shape == (500, 5) and targets.shape == (500, 50) and task.max_new_tokens == 51
    lengths = task.lengths(3, 0, 500)
    assert int(lengths.max()) == 50  # clipped to max_len
    for row, target, n in zip(prompts.tolist(), targets.tolist(), lengths.tolist()):
        assert int("".join(map(str, row[2:4]))) == n
        assert target == [row[1]] * n + [PAD] * (50 - n)
    assert len({row[1] for row in prompts.tolist()}) == 10


def test_longtail_is_a_pure_function_of_seed_and_index():
    task = build_task({"name": "longtail"})
    whole, whole_t = task.prompts(seed=5, index=100, n=16)
    for i in (0, 7, 15):
        one, one_t = task.prompts(seed=5, index=100 + i, n=1)
        assert torch.equal(one[0], whole[i]) and torch.equal(one_t[0], whole_t[i])
    assert torch.equal(task.prompts(5, 100, 16)[1], whole_t)
    assert not torch.equal(task.prompts(6, 100, 16)[0], whole)


def test_longtail_scores_the_exact_answer_one_and_garbage_low():
    task = build_task({"name": "longtail"})
    _, targets = task.prompts(0, 0, 256)
    lengths = torch.from_numpy(task.lengths(0, 0, 256))
    exact = _answer_padded(targets, lengths, task.max_new_tokens)
    assert torch.equal(task.score(exact, targets), torch.ones(256))
    noise = torch.randint(0, VOCAB_SIZE, (256, task.max_new_tokens), generator=torch.Generator().manual_seed(0))
    assert float(task.score(noise, targets).mean()) < 0.25  # mostly the length share: random EOS ~ 18 tokens in
    never_stops = targets[:, :1].expand(256, task.max_new_tokens)  # the right digit, no EOS: length wrong
    assert float(task.score(never_stops, targets).mean()) < 0.2
    assert float(task.score(exact, targets).mean()) > 4 * float(task.score(noise, targets).mean())


def test_longtail_partial_credit_for_digits_and_for_the_length():
    target = torch.tensor([[7] * 5 + [PAD] * 5])

    def score(text: str, **spec) -> float:
        task = build_task({"name": "longtail", "max_len": 10, **spec})
        return float(task.score(torch.tensor([encode(text)]), target)[0])

    for weight in (0.0, 0.5):
        assert score("77777$", length_weight=weight) == 1.0
        assert score("77777$____", length_weight=weight) == 1.0
    # positions only (length_weight 0): the scoring of the other tasks, answers padded with PAD
    assert score("77377$", length_weight=0) == pytest.approx(5 / 6)  # one wrong digit
    assert score("777$", length_weight=0) == pytest.approx(3 / 6)  # stopped early
    assert score("7777777$", length_weight=0) == pytest.approx(5 / 8)  # two too many
    assert score("777_7$", length_weight=0) == pytest.approx(5 / 6)  # a sampled PAD is one wrong token
    assert score("77777_____", length_weight=0) == pytest.approx(5 / 10)  # no EOS: PAD never matches padding
    # half the score for the length alone (the default)
    assert score("12345$") == pytest.approx(0.5 + 0.5 * 1 / 6)  # right length, only the EOS right
    assert score("777$") == pytest.approx(0.5 * 4 / 6 + 0.5 * 3 / 6)
    assert score("7777777$") == pytest.approx(0.5 * 6 / 8 + 0.5 * 5 / 8)
    assert score("$") == pytest.approx(0.5 * 1 / 6)


def _answer_padded(targets: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    out = torch.full((targets.shape[0], width), PAD)
    for i, n in enumerate(lengths.tolist()):
        out[i, :n] = targets[i, :n]
        out[i, n] = EOS
    return out


def test_the_longtail_graph_gives_its_model_room_for_the_longest_answer():
    from pathlib import Path

    import yaml

    graph = yaml.safe_load((Path(__file__).resolve().parents[2] / "graphs" / "grpo-longtail.yaml").read_text())
    task = build_task(graph["nodes"]["prompts"]["config"]["task"])
    assert graph["nodes"]["reward"]["config"]["task"] == graph["nodes"]["prompts"]["config"]["task"]
    for node in ("rollout", "actor"):
        model = graph["nodes"][node]["config"]["model"]
        assert model["max_seq_len"] >= task.prompt_len + task.max_new_tokens, node
