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
