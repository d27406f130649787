"""Math answers: extraction from boxed / #### / last number, and equivalence on known pairs."""

import pytest

from flowrl.rewards import extract_answer, is_equivalent, math_scores, reference_answer
from flowrl.rewards import math as m


@pytest.mark.parametrize("text, want", [
    ("The answer is \\boxed{\\frac{3}{4}}.", "\\frac{3}{4}"),
    ("first \\boxed{1} then \\boxed{x^{2}+1}", "x^{2}+1"),
    ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"),
    ("5 + 7 = 12 apples", "12"),
    ("It costs $1,250.50 in total.", "1,250.50"),
    ("no number here", None),
])
def test_the_final_answer_is_extracted(text, want):
    assert extract_answer(text) == want


@pytest.mark.parametrize("answer, reference", [
    ("12", "12"), ("1,000", "1000"), ("1000.0", "1000"), ("0.75", "3/4"), ("50%", "0.5"),
    ("\\frac{3}{4}", "0.75"), ("x+1", "1+x"), ("2\\sqrt{2}", "\\sqrt{8}"),
])
def test_equal_answers_are_equivalent(answer, reference):
    assert is_equivalent(answer, reference)


@pytest.mark.parametrize("answer, reference", [
    ("13", "12"), ("0.7", "3/4"), (None, "5"), ("x+2", "x+1"), ("banana", "12"),
])
def test_wrong_answers_are_not(answer, reference):
    assert not is_equivalent(answer, reference)


def test_responses_score_one_only_when_right_against_gsm8k_style_references():
    responses = ["5 + 7 = 12, so \\boxed{12}", "I think 13", "12", "", "the answer is 12 apples, not 11"]
    assert math_scores(responses, ["She has 12.\n#### 12"] * 5) == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert reference_answer("blah #### 1,234") == "1,234"


def test_without_math_verify_sympy_still_decides_plain_expressions(monkeypatch):
    monkeypatch.setattr(m, "_math_verify", lambda: None)
    assert is_equivalent("x+1", "1+x") and is_equivalent("2*3", "6") and not is_equivalent("x", "y")
