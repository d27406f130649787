"""The adapters driven by scripted model turns (no model): each answers as its library does.

    python -m pytest -q tests/agents/test_adapters.py

Every test runs the library's own environment next to the adapter, or checks the library's own
scoring, so a disagreement is the adapter's fault. Nothing is downloaded: the SkyRL tasks, the SQL
database and the verifiers taskset are built here.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import sys

import pytest

from flowrl.agents.base import Step


def run(awaitable):
    return asyncio.run(awaitable) if asyncio.iscoroutine(awaitable) else awaitable


# --- SkyRL-Gym ---------------------------------------------------------------------------------

GSM8K_ROWS = [
    {"prompt": [{"role": "system", "content": "Answer with '#### N'."},
                {"role": "user", "content": "Tom has 3 apples and buys 4 more. How many?"}],
     "env_class": "gsm8k", "reward_spec": {"method": "rule", "ground_truth": "7"}},
    {"prompt": "What is 6 times 7?", "reward_spec": {"method": "rule", "ground_truth": "42"}},
]


def test_skyrl_gsm8k_scores_a_correct_answer_1_and_a_wrong_one_0():
    skyrl_gym = pytest.importorskip("skyrl_gym")
    from flowrl.agents.adapters.skyrl import SkyRLEnv

    for answer, expected in [("3 + 4 = 7.\n#### 7", 1.0), ("#### 8", 0.0), ("seven", 0.0)]:
        env = SkyRLEnv("gsm8k", tasks=GSM8K_ROWS)
        first = run(env.reset({"index": 0, "sample": 1, "seed": 9, "ticket": 0}))
        assert first == GSM8K_ROWS[0]["prompt"]
        step = run(env.step(answer))
        lib = skyrl_gym.make("gsm8k", env_config={}, extras={"reward_spec": GSM8K_ROWS[0]["reward_spec"]})
        assert step == Step(messages=[], reward=expected, done=True, info={})
        assert step.reward == lib.step(answer)["reward"]


def test_skyrl_picks_the_row_by_task_index_and_a_string_prompt_becomes_a_user_message():
    pytest.importorskip("skyrl_gym")
    from flowrl.agents.adapters.skyrl import SkyRLEnv

    env = SkyRLEnv("gsm8k", tasks=GSM8K_ROWS)
    assert run(env.reset({"index": 3})) == [{"role": "user", "content": "What is 6 times 7?"}]  # 3 % 2
    assert run(env.step("#### 42")).reward == 1.0
    assert run(env.reset({"index": 1})) == [{"role": "user", "content": "What is 6 times 7?"}]
    assert run(env.step("#### 7")).reward == 0.0


def test_skyrl_multi_turn_gsm8k_gives_the_envs_turn_rewards_and_follow_up_messages():
    skyrl_gym = pytest.importorskip("skyrl_gym")
    from flowrl.agents.adapters.skyrl import SkyRLEnv

    row = {"prompt": "6 * 7?", "reward_spec": {"method": "rule", "ground_truth": "42"}, "max_turns": 3}
    env = SkyRLEnv("gsm8k_multi_turn", tasks=[row])
    lib = skyrl_gym.make("gsm8k_multi_turn", env_config={}, extras={k: v for k, v in row.items() if k != "prompt"})
    run(env.reset({"index": 0}))
    for text in ["I think #### 40", "no answer here", "#### 42"]:
        step, want = run(env.step(text)), lib.step(text)
        assert (step.messages, step.reward, step.done) == (want["observations"], want["reward"], want["done"])
    assert step.done and step.reward == 1.0 and step.info == {"steps": 3}
    assert want["reward"] == 1.0


def test_skyrl_text2sql_runs_the_models_query_on_a_local_database_and_scores_the_solution(tmp_path):
    pytest.importorskip("skyrl_gym")
    from flowrl.agents.adapters.skyrl import SkyRLEnv

    db = tmp_path / "spider" / "database" / "shop" / "shop.sqlite"
    db.parent.mkdir(parents=True)
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE fruit (name TEXT, price INTEGER)")
        conn.executemany("INSERT INTO fruit VALUES (?, ?)", [("apple", 3), ("pear", 5), ("fig", 9)])
    row = {"prompt": "Which fruits cost more than 4?", "db_id": "shop", "data": "spider", "max_turns": 3,
           "reward_spec": {"ground_truth": "SELECT name FROM fruit WHERE price > 4"}}
    env = SkyRLEnv("text2sql", tasks=[row], env_config={"db_path": str(tmp_path)})
    run(env.reset({"index": 0}))
    look = run(env.step("<think>look first</think><sql>SELECT name, price FROM fruit</sql>"))
    assert not look.done and look.reward == 0.0 and len(look.messages) == 1
    assert look.messages[0]["role"] == "user" and "pear" in look.messages[0]["content"]
    assert "<observation>" in look.messages[0]["content"] and look.info["tool_name"] == "sql"
    done = run(env.step("<think>pear and fig</think><solution>SELECT name FROM fruit WHERE price >= 5"
                        "</solution>"))
    assert done == Step(messages=[], reward=1.0, done=True, info={})

    run(env.reset({"index": 0}))                 # a wrong solution: the format is right, the rows are not
    assert run(env.step("<think>guess</think><solution>SELECT name FROM fruit</solution>")).reward == 0.0


def test_skyrl_reads_task_rows_from_jsonl_and_parquet_files(tmp_path):
    pytest.importorskip("skyrl_gym")
    pandas = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    from flowrl.agents.adapters.skyrl import SkyRLEnv

    rows = [{"prompt": [{"role": "user", "content": f"{i}+1?"}], "env_class": "gsm8k",
             "reward_spec": {"method": "rule", "ground_truth": str(i + 1)}} for i in range(3)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pandas.DataFrame(rows).to_parquet(tmp_path / "t.parquet")
    for name in ["t.jsonl", "t.parquet"]:
        env = SkyRLEnv(tasks=str(tmp_path / name))            # each row names its env_class
        assert run(env.reset({"index": 2})) == [{"role": "user", "content": "2+1?"}]
        assert run(env.step("#### 3")).reward == 1.0


def test_skyrl_config_mistakes_name_the_fix():
    pytest.importorskip("skyrl_gym")
    from flowrl.agents.adapters.skyrl import SkyRLEnv

    with pytest.raises(ValueError, match=r"unknown skyrl-gym env id 'gsm9k'.*gsm8k.*text2sql"):
        SkyRLEnv("gsm9k", tasks=GSM8K_ROWS)
    with pytest.raises(ValueError, match="needs tasks"):
        SkyRLEnv("gsm8k")
    with pytest.raises(ValueError, match="needs env_id"):
        SkyRLEnv(tasks=[{"prompt": "x"}])
    with pytest.raises(ValueError, match="does not exist"):
        SkyRLEnv("gsm8k", tasks="no/such/file.jsonl")


def test_an_adapter_whose_library_is_missing_says_what_to_install(monkeypatch):
    from flowrl.agents.adapters.skyrl import SkyRLEnv
    from flowrl.agents.adapters.textarena import TextArenaEnv

    monkeypatch.setitem(sys.modules, "skyrl_gym", None)
    monkeypatch.setitem(sys.modules, "textarena", None)
    with pytest.raises(ImportError, match=r"SkyRLEnv needs skyrl-gym .*pip install 'flowrl\[agents\]'"):
        SkyRLEnv("gsm8k", tasks=GSM8K_ROWS)
    with pytest.raises(ImportError, match=r"TextArenaEnv needs textarena .*pip install 'flowrl\[agents\]'"):
        TextArenaEnv("GuessTheNumber-v0")


# --- TextArena ---------------------------------------------------------------------------------

def _secret(seed: int) -> int:
    """The number TextArena's own GuessTheNumber draws for ``seed``."""
    import textarena as ta

    game = ta.make("GuessTheNumber-v0-raw")
    game.reset(num_players=1, seed=seed)
    return game.game_number


def test_textarena_guess_the_number_answers_hints_and_a_right_guess_wins_1():
    pytest.importorskip("textarena")
    from flowrl.agents.adapters.textarena import TextArenaEnv

    env = TextArenaEnv("GuessTheNumber-v0", seed=100)
    first = run(env.reset({"index": 5, "sample": 0, "seed": 1, "ticket": 0}))
    assert len(first) == 1 and first[0]["role"] == "user"
    assert "Guess The Number" in first[0]["content"] and "between 1 and 20" in first[0]["content"]
    secret = _secret(105)
    low, high = (1, 2) if secret > 2 else (19, 20)
    for guess in (low, high):
        step = run(env.step(f"I guess [{guess}]"))
        hint = "higher" if guess < secret else "lower"
        assert step == Step(messages=[{"role": "user", "content": f"The target number is {hint}."}])
    win = run(env.step(f"[{secret}]"))
    assert win.done and win.reward == 1.0 and win.messages == []
    assert win.info["reason"].startswith("Congratulations") and win.info["turn_count"] == 3


def test_textarena_a_second_invalid_move_ends_the_game_with_the_games_penalty():
    pytest.importorskip("textarena")
    from flowrl.agents.adapters.textarena import TextArenaEnv

    env = TextArenaEnv("GuessTheNumber-v0")
    run(env.reset({"index": 0}))
    warn = run(env.step("no brackets"))
    assert not warn.done and "invalid move" in warn.messages[0]["content"]
    end = run(env.step("still none"))
    assert end.done and end.reward == 0.0 and end.info["invalid_move"] is True   # no guess yet: 0% done
    with pytest.raises(RuntimeError, match="after the game ended"):
        run(env.step("[3]"))


def test_textarena_tower_of_hanoi_solved_in_seven_moves_wins_1():
    pytest.importorskip("textarena")
    from flowrl.agents.adapters.textarena import TextArenaEnv

    env = TextArenaEnv("TowerOfHanoi-v0", system_prompt="Answer with one move like [A C].")
    first = run(env.reset({"index": 0}))
    assert first[0] == {"role": "system", "content": "Answer with one move like [A C]."}
    assert "Current Board" in first[1]["content"] and "A: [3, 2, 1]" in first[1]["content"]
    moves = ["A C", "A B", "C B", "A C", "B A", "B C", "A C"]
    for i, move in enumerate(moves):
        step = run(env.step(f"[{move}]"))
        assert step.done == (i == len(moves) - 1)
        if not step.done:                           # the model's own move is not echoed back
            assert "You moved disk" in step.messages[0]["content"] and f"[{move}]" not in step.messages[0]["content"]
    assert step.reward == 1.0


def test_textarena_samples_of_a_task_and_a_replay_play_the_same_game_other_tasks_another():
    pytest.importorskip("textarena")
    from flowrl.agents.adapters.textarena import TextArenaEnv

    def play(index: int, sample: int, env=None) -> list:
        """The game's answers to guesses 1, 2, 3, ... up to the right one (which tells the secret)."""
        env = env or TextArenaEnv("GuessTheNumber-v0", env_kwargs={"max_turns": 20})
        run(env.reset({"index": index, "sample": sample, "seed": 1000 * sample + index}))
        answers = []
        for guess in range(1, 21):
            answers.append(run(env.step(f"[{guess}]")).messages)
            if not answers[-1]:
                return answers
        raise AssertionError("no guess from 1 to 20 won")

    assert play(4, 0) == play(4, 3) == play(4, 0, TextArenaEnv("GuessTheNumber-v0", env_kwargs={"max_turns": 20}))
    assert len({str(play(i, 0)) for i in range(8)}) > 1
    assert len(play(4, 0)) == _secret(4)           # the secret of TextArena's own game, seed 0 + 4


def test_textarena_concurrent_episodes_keep_their_own_random_draws():
    pytest.importorskip("textarena")
    from flowrl.agents.adapters.textarena import TextArenaEnv

    def alone(index: int) -> list:
        env = TextArenaEnv("2048-v0")
        run(env.reset({"index": index}))
        return [run(env.step(f"[{m}]")).messages for m in ("w", "a", "s", "d")]

    a, b = TextArenaEnv("2048-v0"), TextArenaEnv("2048-v0")
    run(a.reset({"index": 1}))
    run(b.reset({"index": 2}))
    both = [(run(a.step(f"[{m}]")).messages, run(b.step(f"[{m}]")).messages) for m in ("w", "a", "s", "d")]
    assert [x for x, _ in both] == alone(1) and [y for _, y in both] == alone(2)


def test_textarena_config_mistakes_name_the_fix():
    pytest.importorskip("textarena")
    from flowrl.agents.adapters.textarena import TextArenaEnv

    with pytest.raises(ValueError, match=r"unknown textarena env id 'GuessNumber-v0'.*GuessTheNumber-v0"):
        TextArenaEnv("GuessNumber-v0")
    with pytest.raises(ValueError, match="single-player games only; TicTacToe-v0"):
        TextArenaEnv("TicTacToe-v0").reset({"index": 0})
    with pytest.raises(ValueError, match="seed_by"):
        TextArenaEnv("GuessTheNumber-v0", seed_by="ticket")


# --- verifiers (0.4: verifiers.v1) -------------------------------------------------------------

VF_PLUGIN = '''
"""A verifiers taskset and an in-process chat harness (verifiers' own null/bash harnesses
bootstrap their program with `uv sync`, which needs the network)."""
import openai
import verifiers.v1 as vf
from verifiers.v1.runtimes import ProgramResult


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, trace) -> float:
        reply = trace.branches[-1].messages[-1].content
        return 1.0 if reply.strip().endswith("#### " + self.data.answer) else 0.0


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        for a, b in [(2, 3), (6, 7), (10, 1)]:
            yield SumTask(SumData(prompt=f"What is {a}+{b}?", answer=str(a + b)), self.config.task)


class ChatHarness(vf.Harness[vf.HarnessConfig]):
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kwargs):
        client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret)
        await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": data.prompt}])
        return ProgramResult(0, "", "")


__all__ = ["SumTaskset", "ChatHarness"]
'''


def test_verifiers_agent_runs_a_verifiers_episode_through_the_given_client_and_returns_its_reward(tmp_path,
                                                                                                monkeypatch):
    pytest.importorskip("verifiers.v1")
    openai = pytest.importorskip("openai")
    web = pytest.importorskip("aiohttp.web")
    from flowrl.agents.adapters.verifiers import VerifiersEpisodeError, verifiers_agent

    (tmp_path / "flowrl_vf_sums.py").write_text(VF_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[tuple[str, str | None, str | None]] = []

    async def chat(request):                     # the scripted model: right on 2+3 and 10+1, wrong on 6+7
        body = await request.json()
        question = body["messages"][-1]["content"]
        seen.append((question, request.headers.get("Authorization"), request.headers.get("X-Flowrl-Session")))
        if "10+1" in question and request.headers.get("X-Flowrl-Session") == "boom":
            return web.json_response({"error": {"message": "engine gone"}}, status=400)
        answer = {"What is 2+3?": "5", "What is 6+7?": "12"}.get(question, "11")
        return web.json_response({"id": "c1", "object": "chat.completion", "created": 0, "model": body["model"],
                                  "choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant", "content": f"So: #### {answer}"}}],
                                  "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}})

    async def main():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"
        agent = verifiers_agent({"taskset": {"id": "flowrl_vf_sums"},
                                 "agent": {"harness": {"id": "flowrl_vf_sums"}, "runtime": {"type": "subprocess"}}})
        try:
            rewards = []
            for index, session in [(0, "e0"), (1, "e1"), (5, "e5")]:     # index 5 is task 5 % 3 = 2
                client = openai.AsyncOpenAI(base_url=url, api_key="run-token",
                                            default_headers={"X-Flowrl-Session": session})
                rewards.append(await agent(client, {"index": index, "sample": 0, "seed": 0, "ticket": 0}))
            client = openai.AsyncOpenAI(base_url=url, api_key="run-token", default_headers={"X-Flowrl-Session": "boom"})
            with pytest.raises(VerifiersEpisodeError, match="verifiers episode for task 2 failed"):
                await agent(client, {"index": 2})
            return rewards
        finally:
            await agent.aclose()
            await runner.cleanup()

    assert asyncio.run(main()) == [1.0, 0.0, 1.0]
    assert seen[:3] == [("What is 2+3?", "Bearer run-token", "e0"), ("What is 6+7?", "Bearer run-token", "e1"),
                        ("What is 10+1?", "Bearer run-token", "e5")]


def test_verifiers_agent_without_verifiers_says_what_to_install(monkeypatch):
    from flowrl.agents.adapters.verifiers import verifiers_agent

    monkeypatch.setitem(sys.modules, "verifiers", None)
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(ImportError, match=r"verifiers_agent needs verifiers>=0.4 .*pip install 'flowrl\[agents\]'"):
        asyncio.run(verifiers_agent({"taskset": {"id": "x"}})(object(), {"index": 0}))
