"""The built-in environments: pure functions of the task, rewards as documented."""

from __future__ import annotations

import pytest

from flowrl.agents.base import ToolCall
from flowrl.agents.tools import ToolResult
from flowrl.agents.envs import CalcEnv, GuessEnv, positional_share, resolve_env


def test_a_task_is_a_pure_function_of_its_seed_and_index():
    assert CalcEnv().reset({"index": 3, "seed": 1}) == CalcEnv().reset({"index": 3, "seed": 1, "sample": 5})
    problems = {CalcEnv().reset({"index": i, "seed": 1}) for i in range(50)}
    assert len(problems) == 50
    a, b = CalcEnv(modulus=None).reset({"index": 0, "seed": 0}).split("*")
    assert len(a) == len(b) == 3
    envs = [GuessEnv(), GuessEnv()]
    for env in envs:
        assert env.reset({"index": 7, "seed": 2}) == "?"
    assert envs[0].hidden == envs[1].hidden


def test_the_guessing_hidden_digits_cover_zero_to_nine():
    seen = set()
    for i in range(200):
        env = GuessEnv()
        env.reset({"index": i, "seed": 0})
        seen.add(env.hidden)
    assert seen == set(range(10))


def test_a_right_call_and_answer_score_one_and_the_parts_score_as_documented():
    env = CalcEnv()
    question = env.reset({"index": 0, "seed": 0})
    a, rest = question.split("*")
    b, m = rest.split("%")
    answer = str(int(a) * int(b) % int(m))
    assert (len(a), len(b), m) == (3, 3, "7") and env.answer == answer
    call = env.prepare_call(ToolCall("calc", {"expr": ""}, "c0"))  # `=` alone: the question on screen
    assert call == ToolCall("calc", {"expr": question}, "c0")
    assert env.prepare_call(ToolCall("calc", {"expr": "1+1"})).arguments == {"expr": "1+1"}
    assert env.on_tools([call], [ToolResult(answer)]) == pytest.approx(0.2)
    assert env.on_tools([call], [ToolResult(answer)]) == 0.0  # only the first call
    step = env.step(answer + "$junk")  # the leading digits are the answer
    assert step.done and step.reward == pytest.approx(0.8) and step.info["answer_share"] == 1.0
    assert env.step(answer + "1").reward == pytest.approx(0.4)  # an extra digit counts as wrong
    env.reset({"index": 0, "seed": 0})
    assert env.on_tools([ToolCall("calc", {"expr": "1"})], [ToolResult("1" if answer != "1" else "2")]) \
        == pytest.approx(0.1)  # a call that does not answer the question: half


def test_the_whole_product_variant_asks_for_every_digit():
    env = CalcEnv(modulus=None)
    question = env.reset({"index": 3, "seed": 0})
    a, b = question.split("*")
    assert env.answer == str(int(a) * int(b))
    assert env.step(env.answer).reward == pytest.approx(0.8)
    with pytest.raises(ValueError, match="modulus=11"):
        CalcEnv(modulus=11)


def test_shares_count_extra_characters_as_wrong():
    assert positional_share("123", "123") == 1.0 and positional_share("1234", "123") == 0.75
    assert positional_share("", "12") == 0.0 and positional_share("", "") == 1.0


def test_guessing_answers_lower_higher_or_not_a_digit_until_found_or_out_of_guesses():
    env = GuessEnv(max_guesses=3)
    env.reset({"index": 0, "seed": 0})
    h = env.hidden
    wrong = (h + 5) % 10
    step = env.step(str(wrong))
    assert step.messages == [{"role": "user", "content": "<" if h < wrong else ">"}] and not step.done
    assert env.step("x").messages[0]["content"] == "?"
    last = env.step(str(h) + "junk")  # the first character is the guess
    assert last.done and last.reward == 1.0
    env.reset({"index": 0, "seed": 0})
    for _ in range(2):
        assert not env.step("x").done
    end = env.step("x")
    assert end.done and end.reward == 0.0


def test_envs_resolve_by_name_or_import_path():
    assert resolve_env("calc") is CalcEnv and resolve_env("flowrl.agents.envs:GuessEnv") is GuessEnv
    with pytest.raises(ValueError, match="calc, guess"):
        resolve_env("chess")
