"""The episode loop: token exactness, the mask, every way an episode ends."""

from __future__ import annotations

import anyio
import pytest

from flowrl.agents.chat import chat_format
from flowrl.agents.episode import EpisodeLimits, run_episode
from flowrl.agents.tools import Tools
from flowrl.data.tokenizer import CharTokenizer
from flowrl.tasks import EOS
from flowrl.agents.envs import CalcEnv
from tests.agents.fakes import AsyncHangEnv, EchoEnv, ScriptedGen

FMT = chat_format({"type": "tiny", "vocab_size": 102})
TOK = CharTokenizer()
TASK = {"index": 4, "sample": 0, "seed": 1, "ticket": "b0"}


def ids(text: str) -> list[int]:
    return TOK.encode(text)[1:]


def episode(env, gen, limits=EpisodeLimits(max_turns=8, max_tokens=200, deadline_s=10), tools=None, **kw):
    async def go():
        try:
            return await run_episode(env, TASK, gen, FMT, limits=limits, tools=tools, session="b0:0:2",
                                     min_version=1, seed=5, max_new_tokens=kw.get("max_new_tokens", 16))
        finally:
            if hasattr(env, "release"):
                env.release.set()  # a sync env left hanging in its thread: the loop waits for it on close
    return anyio.run(go)


def check_aligned(traj):
    n = len(traj.tokens)
    assert len(traj.mask) == len(traj.logprobs) == len(traj.versions) == n
    assert sum(k for _, k in traj.segments) == n
    pos = 0
    for kind, k in traj.segments:
        assert all(m == (kind == "model") for m in traj.mask[pos:pos + k])
        if kind != "model":
            assert traj.versions[pos:pos + k] == [-1] * k and traj.logprobs[pos:pos + k] == [0.0] * k
        pos += k


def test_trajectory_tokens_are_start_then_each_completion_then_each_extend_exactly():
    gen = ScriptedGen([ids("ab"), ids("cde")])
    traj = episode(EchoEnv(turns=2), gen)
    assert traj.finish == "done" and traj.turns == 2 and traj.reward == 0.5 and traj.turn_rewards == [0.25, 0.25]
    start = FMT.start([{"role": "user", "content": "task 4"}])
    c1, c2 = gen.completions
    want = start + c1.tokens + FMT.extend([{"role": "user", "content": "ok"}]) + c2.tokens
    assert traj.tokens == want and traj.prompt_len == len(start)
    assert gen.prompts[0] == start and gen.prompts[1] == want[: len(want) - len(c2.tokens)]  # the whole history
    assert traj.segments == [("prompt", len(start)), ("model", 3), ("env", 3), ("model", 4)]
    check_aligned(traj)
    model = [j for j, m in enumerate(traj.mask) if m]
    assert [traj.tokens[j] for j in model] == c1.tokens + c2.tokens
    assert [traj.logprobs[j] for j in model] == c1.logprobs + c2.logprobs
    assert [traj.versions[j] for j in model] == [3] * 7
    assert c1.tokens[-1] == EOS  # the stop token is kept as generated


def test_tool_calls_run_the_tools_and_their_results_are_tool_segments():
    gen = ScriptedGen([ids("=12*34"), ids("408")])
    env = CalcEnv(digits=2)
    traj = episode(env, gen, tools=Tools(["calc"]))
    assert traj.finish == "done" and traj.turns == 2 and traj.tool_calls == 1
    assert [k for k, _ in traj.segments] == ["prompt", "model", "tool", "model"]
    tool_start = traj.segments[0][1] + traj.segments[1][1]
    assert traj.tokens[tool_start: tool_start + traj.segments[2][1]] == ids("408\n")
    check_aligned(traj)
    # without tools the same turn is an answer to the environment
    traj = episode(CalcEnv(digits=2), ScriptedGen([ids("=12*34")]))
    assert traj.tool_calls == 0 and traj.turns == 1 and traj.finish == "done"


def test_a_failing_tool_is_a_message_and_the_episode_goes_on():
    gen = ScriptedGen([ids("=1/0"), ids("7")])
    traj = episode(CalcEnv(digits=1), gen, tools=Tools(["calc"]))
    assert traj.finish == "done" and traj.info["tool_errors"] == 1 and traj.turns == 2
    shown = gen.prompts[1][len(gen.prompts[0]) + len(gen.completions[0].tokens):]  # the tool message
    assert TOK.decode(shown) == "error: ZeroDivisionError: division by zero\n"


def test_max_turns_ends_the_episode_with_the_sum_of_its_rewards():
    traj = episode(EchoEnv(turns=100), ScriptedGen([ids("x")]), EpisodeLimits(max_turns=3, max_tokens=500))
    assert (traj.finish, traj.turns, traj.reward) == ("max_turns", 3, 0.75)
    check_aligned(traj)


@pytest.mark.parametrize("budget", [12, 13, 14, 15, 16, 17, 20, 25])
def test_the_token_budget_holds_and_caps_each_turn(budget):
    gen = ScriptedGen([ids("abcdef")])  # 7 tokens a turn with EOS
    traj = episode(EchoEnv(turns=100), gen, EpisodeLimits(max_turns=50, max_tokens=budget))
    assert traj.finish == "token_budget" and len(traj.tokens) <= budget
    start = len(FMT.start([{"role": "user", "content": "task 4"}]))  # 8
    assert gen.prompts[0] and len(gen.prompts[0]) == start
    check_aligned(traj)


def test_an_env_that_raises_ends_the_episode_with_the_error_reward():
    limits = EpisodeLimits(max_turns=4, max_tokens=100, error_reward=-1.0)
    traj = episode(EchoEnv(fail_on="step"), ScriptedGen([ids("a")]), limits)
    assert traj.finish == "env_error" and traj.reward == -1.0 and "KeyError" in traj.error and "state lost" in traj.error
    check_aligned(traj)
    traj = episode(EchoEnv(fail_on="reset"), ScriptedGen([ids("a")]), limits)
    assert traj.finish == "env_error" and traj.tokens == [] and "no such task" in traj.error


@pytest.mark.timeout(20)
@pytest.mark.parametrize("env", [AsyncHangEnv(), EchoEnv(hang_on="step")], ids=["async", "sync"])
def test_a_hanging_env_ends_at_the_deadline(env):
    limits = EpisodeLimits(max_turns=4, max_tokens=100, deadline_s=2)  # room for turn 1 (and a thread) first
    traj = episode(env, ScriptedGen([ids("a")]), limits)
    assert traj.finish == "deadline" and traj.reward == 0.0 and "2s" in traj.error
    assert traj.turns == 1
    check_aligned(traj)


@pytest.mark.timeout(20)
def test_a_hanging_generator_ends_at_the_deadline():
    traj = episode(EchoEnv(), ScriptedGen([ids("a")], hang=True), EpisodeLimits(deadline_s=0.2))
    assert traj.finish == "deadline" and traj.turns == 0


def test_a_service_error_ends_the_episode_as_rollout_error():
    traj = episode(EchoEnv(turns=5), ScriptedGen([ids("a")], fail_at=1), EpisodeLimits(error_reward=0.5))
    assert traj.finish == "rollout_error" and traj.reward == 0.5 and "shutting down" in traj.error
    assert traj.turns == 1
    check_aligned(traj)


@pytest.mark.timeout(60)
def test_episodes_over_a_real_engine_are_token_exact():
    """A random tiny model through EngineGenerator over a continuous engine: many episodes at once."""
    from flowrl.agents.local import EngineGenerator
    from flowrl.engines import build_engine

    spec = {"type": "tiny", "vocab_size": 102, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 64}
    engine = build_engine({"type": "builtin", "continuous": True, "max_num_seqs": 16}, model=spec, seed=0)
    engine.load_weights(engine.weights().items(), version=2)
    gen = EngineGenerator(engine)
    limits = EpisodeLimits(max_turns=3, max_tokens=64, deadline_s=30)

    async def go():
        import asyncio

        return await asyncio.gather(*[
            run_episode(CalcEnv(), {"index": i, "seed": 0}, gen, FMT, limits=limits, tools=Tools(["calc"]),
                        session=f"b:0:{i}", seed=i, max_new_tokens=8) for i in range(12)])

    for traj in anyio.run(go):
        check_aligned(traj)
        assert traj.finish in ("done", "max_turns", "token_budget") and len(traj.tokens) <= 64
        model = [j for j, m in enumerate(traj.mask) if m]
        assert model and all(traj.versions[j] == 2 for j in model)
        assert all(traj.logprobs[j] < 0 for j in model)
        # the model's turns re-scored by the policy give the engine's log-probs (nothing re-tokenized)
        import torch

        from flowrl.models.packing import packed_logprobs
        from flowrl.transport.ragged import Ragged

        lp = packed_logprobs(engine.model, Ragged.from_sequences([traj.tokens], "int64"), temperature=1.0)
        got = lp.values[torch.tensor(model)]
        assert torch.allclose(got, torch.tensor([traj.logprobs[j] for j in model]), atol=1e-4)
    engine.close()
