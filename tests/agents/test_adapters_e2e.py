"""The adapters under the episode runner with a real (random, tiny) chat model: token exact.

    python -m pytest -q tests/agents/test_adapters_e2e.py

A trajectory must be exactly the chat format's first prompt, then each completion's tokens as the
generator returned them, then each ``extend`` of the environment's messages, in order; the loss
mask is True exactly on the completions. Skips until the episode runner, the chat formats and the
test chat model are present.
"""

from __future__ import annotations

import asyncio

import pytest

episode = pytest.importorskip("flowrl.agents.episode")
local = pytest.importorskip("flowrl.agents.local")
chat = pytest.importorskip("flowrl.agents.chat")
chat_model = pytest.importorskip("flowrl.testing.chat_model")
pytest.importorskip("transformers")


class Recorded:
    """An Env wrapper that keeps what the environment said (reset's messages, each step)."""

    def __init__(self, env):
        self.env, self.first, self.steps = env, None, []

    async def reset(self, task):
        out = self.env.reset(task)
        self.first = await out if asyncio.iscoroutine(out) else out
        return self.first

    async def step(self, text):
        out = self.env.step(text)
        step = await out if asyncio.iscoroutine(out) else out
        self.steps.append(step)
        return step


class RecordingGen:
    """A Generator wrapper that keeps every completion's tokens as the engine returned them."""

    def __init__(self, gen):
        self.gen, self.completions = gen, []

    async def complete(self, prompt, **kwargs):
        out = await self.gen.complete(prompt, **kwargs)
        self.completions.append(list(out.tokens))
        return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(chat_model.write_chat_model(tmp_path_factory.mktemp("chat-model"), seed=0))


@pytest.fixture(scope="module")
def engine(model_dir):
    from flowrl.engines import build_engine

    eng = build_engine({"type": "hf"}, model={"type": "hf", "path": model_dir}, seed=0)
    yield eng
    if hasattr(eng, "close"):
        eng.close()


def _check_token_exact(traj, env: Recorded, gen: RecordingGen, fresh_fmt):
    messages = list(env.first)
    expected = [("prompt", fresh_fmt.start(messages))]
    completions, steps = iter(gen.completions), iter(env.steps)
    for kind, n in traj.segments[1:]:
        if kind == "model":
            expected.append(("model", next(completions)))
        else:
            assert kind == "env", traj.segments
            expected.append(("env", fresh_fmt.extend(next(steps).messages)))
    assert [(k, len(ids)) for k, ids in expected] == traj.segments
    assert traj.tokens == [t for _, ids in expected for t in ids]
    assert traj.mask == [k == "model" for k, ids in expected for _ in ids]
    assert traj.prompt_len == len(expected[0][1])
    if traj.finish == "done":
        assert traj.reward == pytest.approx(sum(s.reward for s in env.steps))


def _pad_id(model_dir: str) -> int:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_dir).pad_token_id


def _run(env, engine, model_dir, task, turns: int):
    fmt = chat.chat_format({"type": "hf", "path": model_dir})
    gen = RecordingGen(local.EngineGenerator(engine, pad_id=_pad_id(model_dir)))
    recorded = Recorded(env)
    limits = episode.EpisodeLimits(max_turns=turns, max_tokens=4000, deadline_s=120)
    traj = asyncio.run(episode.run_episode(recorded, task, gen, fmt, limits=limits, tools=None, session="e2e:0",
                                           min_version=0, seed=task["seed"], max_new_tokens=12))
    assert traj.error is None, traj.error
    _check_token_exact(traj, recorded, gen, chat.chat_format({"type": "hf", "path": model_dir}))
    return traj, recorded


@pytest.mark.timeout(120)
def test_a_skyrl_multi_turn_episode_with_a_model_is_token_exact(engine, model_dir):
    pytest.importorskip("skyrl_gym")
    from flowrl.agents.adapters.skyrl import SkyRLEnv

    env = SkyRLEnv("gsm8k_multi_turn", tasks=[{"prompt": "6*7?", "max_turns": 3,
                                               "reward_spec": {"method": "rule", "ground_truth": "42"}}])
    traj, recorded = _run(env, engine, model_dir, {"index": 0, "sample": 0, "seed": 3, "ticket": 0}, turns=5)
    assert traj.finish == "done" and traj.turns == 3 and len(recorded.steps) == 3   # the env ends it at 3


@pytest.mark.timeout(120)
def test_a_textarena_game_with_a_model_is_token_exact(engine, model_dir):
    pytest.importorskip("textarena")
    from flowrl.agents.adapters.textarena import TextArenaEnv

    env = TextArenaEnv("GuessTheNumber-v0")
    traj, recorded = _run(env, engine, model_dir, {"index": 1, "sample": 0, "seed": 5, "ticket": 0}, turns=4)
    assert traj.finish in ("done", "max_turns") and traj.turns == len(recorded.steps)
