"""The built-in environments: pure functions of the task, rewards as documented."""

from __future__ import annotations

import pytest

from flowrl.agents.base import ToolCall
from flowrl.agents.tools import ToolResult
from flowrl.agents.envs import CalcEnv, GuessEnv, char_credit, positional_share, resolve_env


def test_a_task_is_a_pure_function_of_its_seed_and_index():
    assert CalcEnv().reset({"index": 3, "seed": 1}) == CalcEnv().reset({"index": 3, "seed": 1, "sample": 5})
    problems = {CalcEnv().reset({"index": i, "seed": 1}) for i in range(50)}
    assert len(problems) == 50
    a, b = CalcEnv().reset({"index": 0, "seed": 0}).split("*")
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
    expr = env.reset({"index": 0, "seed": 0})
    product = str(eval(expr))  # noqa: S307 - the test's own string
    assert env.on_tools([ToolCall("calc", {"expr": expr})], [ToolResult(product)]) == 0.5
    assert env.on_tools([ToolCall("calc", {"expr": expr})], [ToolResult(product)]) == 0.0  # only the first call
    step = env.step(product + "$junk")  # the leading digits are the answer
    assert step.done and step.reward == 0.5 and step.info["answer_share"] == 1.0
    # half the answer's digits: half the answer's weight
    env.reset({"index": 0, "seed": 0})
    env.on_tools([ToolCall("calc", {"expr": expr})], [ToolResult(product)])
    assert env.step(product[:3] + "x").reward == pytest.approx(0.5 * 3 / 6)
    # no call: the answer is worth nothing (gate); ungated, its share counts
    env.reset({"index": 0, "seed": 0})
    assert env.step(product).reward == 0.0
    ungated = CalcEnv(gate=False)
    ungated.reset({"index": 0, "seed": 0})
    assert ungated.step(product).reward == 0.5
    # a junk call: half the call weight for calling, its answer gated by how much of the question it had
    env.reset({"index": 0, "seed": 0})
    junk = "5555555"
    r = env.on_tools([ToolCall("calc", {"expr": junk})], [ToolResult(junk)])
    assert r == pytest.approx(0.5 * (0.5 + 0.5 * char_credit(junk, expr))) and r < 0.4
    assert env.step(product).reward == pytest.approx(0.5 * positional_share(junk, expr))
    # the copy term rewards repeating the tool's answer, in proportion to the call's share
    env = CalcEnv(copy_weight=0.2)
    env.reset({"index": 0, "seed": 0})
    env.on_tools([ToolCall("calc", {"expr": expr[:4]})], [ToolResult("123")])
    assert env.step("123").reward == pytest.approx(0.2 * 4 / 7 + 0.5 * 4 / 7 * positional_share("123", product))


def test_shares_count_extra_characters_as_wrong_and_credit_the_right_kind():
    assert positional_share("123", "123") == 1.0 and positional_share("1234", "123") == 0.75
    assert positional_share("", "12") == 0.0
    assert char_credit("1*9", "2*9") == pytest.approx((0.25 + 1 + 1) / 3)
    assert char_credit("a", "2") == 0.0


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
