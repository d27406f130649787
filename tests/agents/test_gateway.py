"""The OpenAI-compatible gateway: the official ``openai`` client end to end, token ids reused
exactly across calls (never re-tokenized), the per-session key, bad requests, rollout errors, and
episodes run with ``run_agent_episode``; against a scripted generator and a real engine over the
tiny chat model.

    pytest tests/agents/test_gateway.py
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")
transformers = pytest.importorskip("transformers")

from flowrl.agents.base import Completion, ServiceError, ToolCall  # noqa: E402
from flowrl.agents.gateway import Gateway, call_seed  # noqa: E402
from flowrl.agents.openai_agent import Limits, run_agent_episode, stop_process_gateway  # noqa: E402
from flowrl.testing.chat_model import write_chat_model  # noqa: E402

pytestmark = pytest.mark.timeout(120)

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
QUESTION = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is 2+3?"}]
CALL_TEXT = 'Adding.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return str(write_chat_model(tmp_path_factory.mktemp("chat-model"), seed=0))


@pytest.fixture(scope="module")
def tok(chat_dir):
    transformers.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(chat_dir)


class HermesFormat:
    """A minimal ChatFormat for the chat model (``flowrl.agents.chat`` builds the real ones):
    ``start`` renders the template; ``extend`` renders the new messages after a stand-in exchange
    and keeps what follows the stand-in assistant turn's stop token."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.stop_ids = (tok.convert_tokens_to_ids("<|im_end|>"),)
        self.started: list[list[dict]] = []

    def render(self, messages, tools=None, gen=True) -> list[int]:
        out = self.tok.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def start(self, messages, tools=None):
        self.started.append(messages)
        return self.render(messages, tools)

    def extend(self, messages):
        stub = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        base, full = self.render(stub, gen=False), self.render(stub + list(messages))
        cut = len(base) - base[::-1].index(self.stop_ids[0])  # just after the stand-in turn's stop token
        assert full[:cut] == base[:cut]
        return full[cut:]

    def text(self, tokens):
        return self.tok.decode(list(tokens), skip_special_tokens=True)

    def tool_calls(self, text):
        calls = []
        for body in re.findall(r"<tool_call>(.*?)</tool_call>", text, re.S):
            d = json.loads(body)
            calls.append(ToolCall(d["name"], d.get("arguments", {})))
        return calls

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False)


def spell(tok, text: str, stop: bool = True) -> list[int]:
    """``text`` one character per id, as a model may generate it (``<tool_call>`` spelled out in 11
    characters, where the tokenizer would make it one token), then the stop token."""
    ids = [tok.convert_tokens_to_ids(ch) for ch in text]
    assert tok.unk_token_id not in ids
    return ids + ([tok.convert_tokens_to_ids("<|im_end|>")] if stop else [])


class ScriptedGen:
    """Answers each call with the next preset turn; records what it was asked."""

    def __init__(self, turns: list[list[int]], finish: list[str] | None = None, error: Exception | None = None):
        self.turns, self.finish, self.error = list(turns), list(finish or []), error
        self.calls: list[dict[str, Any]] = []
        self.block: asyncio.Event | None = None
        self.release_at = 0
        """With ``block``: calls wait until this many calls were made, then all go on."""

    async def complete(self, prompt, *, session, max_new_tokens, stop=(), min_version=0, seed=0, timeout_s=None):
        self.calls.append(dict(prompt=list(prompt), session=session, max_new_tokens=max_new_tokens, stop=tuple(stop),
                               min_version=min_version, seed=seed))
        if self.block is not None:
            if self.release_at and len(self.calls) >= self.release_at:
                self.block.set()
            await self.block.wait()
        if self.error is not None:
            raise self.error
        tokens = self.turns.pop(0)[:max_new_tokens]
        n = len(tokens)
        return Completion(tokens, [-0.5 - 0.01 * j for j in range(n)], [min_version] * n,
                          self.finish.pop(0) if self.finish else "stop")


class EngineGen:
    """A flowrl rollout engine as a Generator (``flowrl.agents.local`` has the real one)."""

    def __init__(self, engine: Any, pad: int) -> None:
        self.engine, self.pad, self.outs = engine, pad, []

    async def complete(self, prompt, *, session, max_new_tokens, stop=(), min_version=0, seed=0, timeout_s=None):
        from flowrl.engines import Sampling

        sampling = Sampling(n=1, temperature=1.0, max_new_tokens=max_new_tokens, eos_id=stop[0], pad_id=self.pad,
                            stop_token_ids=tuple(stop[1:]))
        out = await asyncio.to_thread(self.engine.generate, [list(prompt)], sampling, seed=seed)
        plen = int(out.prompt_lens[0])
        tokens, lps = out.tokens[0].tolist()[plen:], out.logprobs[0].tolist()[plen:]
        done = Completion(tokens, lps, [self.engine.version] * len(tokens),
                          "stop" if tokens and tokens[-1] in stop else "length")
        self.outs.append(done)
        return done


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def serve(gen, fmt, **kw):
    gw = Gateway(**{k: kw.pop(k) for k in ("request_timeout_s", "max_body_bytes") if k in kw})
    await gw.start()
    base_url, key = gw.open_session("t0-0-0", gen, fmt, **{"seed": 7, "min_version": 3, **kw})
    return gw, openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=30)


def test_openai_client_gets_tool_calls_and_the_follow_up_reuses_the_engine_tokens_exactly(tok):
    fmt = HermesFormat(tok)
    turn1, turn2 = spell(tok, CALL_TEXT), spell(tok, "It is 5.")
    gen = ScriptedGen([turn1, turn2])

    async def main():
        gw, client = await serve(gen, fmt, max_new_tokens=200)
        try:
            r1 = await client.chat.completions.create(model="policy", messages=QUESTION, tools=TOOLS)
            msg = r1.choices[0].message
            assert r1.choices[0].finish_reason == "tool_calls"
            assert msg.content == "Adding."
            [call] = msg.tool_calls
            assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
            assert r1.usage.completion_tokens == len(turn1)
            tool_msg = {"role": "tool", "tool_call_id": call.id, "content": "5"}
            history = [*QUESTION, msg.model_dump(exclude_none=True), tool_msg]
            r2 = await client.chat.completions.create(model="policy", messages=history, tools=TOOLS,
                                                      temperature=0.0, max_tokens=50)
            assert r2.choices[0].message.content == "It is 5." and r2.choices[0].finish_reason == "stop"
            return gw.close_session("t0-0-0"), gw.stats()
        finally:
            await client.close()
            await gw.stop()

    traj, stats = run(main())
    assert fmt.started == [QUESTION]  # formatted once; the follow-up only extended
    prompt, env = fmt.render(QUESTION, TOOLS), fmt.extend([{"role": "tool", "content": "5"}])
    assert traj.tokens == prompt + turn1 + env + turn2
    assert gen.calls[1]["prompt"] == prompt + turn1 + env  # the engine was asked with the reused ids
    assert traj.mask == [False] * len(prompt) + [True] * len(turn1) + [False] * len(env) + [True] * len(turn2)
    assert traj.segments == [("prompt", len(prompt)), ("model", len(turn1)), ("env", len(env)), ("model", len(turn2))]
    assert traj.prompt_len == len(prompt) and traj.turns == 2 and traj.tool_calls == 1 and traj.finish == "done"
    assert [lp for lp, m in zip(traj.logprobs, traj.mask) if m][:2] == [-0.5, -0.51]
    assert {v for v, m in zip(traj.versions, traj.mask) if not m} == {-1}
    assert {v for v, m in zip(traj.versions, traj.mask) if m} == {3}
    assert traj.info["diverged"] == 0 and stats["diverged"] == 0 and stats["unauthorized"] == 0
    assert [c["seed"] for c in gen.calls] == [call_seed(7, 0), call_seed(7, 1)]
    assert {(c["session"], c["min_version"], c["stop"]) for c in gen.calls} == {("t0-0-0", 3, fmt.stop_ids)}
    assert gen.calls[1]["max_new_tokens"] == 50

    # Re-rendering the conversation from its text re-tokenizes the model's turns: the spelled-out
    # "<tool_call>" becomes one token, so a trainer fed the re-rendered ids would train on tokens
    # the engine never generated.
    answer = {"role": "assistant", "content": "Adding.",
              "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}
    rendered = fmt.render([*QUESTION, answer, {"role": "tool", "content": "5"},
                           {"role": "assistant", "content": "It is 5."}], TOOLS, gen=False)
    assert tok.decode(rendered[len(prompt):]).startswith("Adding.\n<tool_call>")
    assert rendered[:len(traj.tokens)] != traj.tokens
    assert rendered[len(prompt):len(prompt) + len(turn1)] != turn1


@pytest.mark.parametrize("engine", ["builtin", "hf"])
def test_a_real_engine_over_the_chat_model_serves_an_openai_agent_token_exactly(chat_dir, tok, engine):
    import torch

    from flowrl.engines import build_engine

    torch.set_num_threads(1)
    fmt = HermesFormat(tok)
    gen = EngineGen(build_engine({"type": engine}, model={"type": "hf", "path": chat_dir}, seed=0), tok.pad_token_id)
    seen = []

    async def agent(client, task):
        messages = [{"role": "user", "content": f"Say {task['word']}."}]
        for _ in range(2):
            r = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            seen.append(r.choices[0])
            messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Again."}]
        return {"reward": 0.5, "said": r.choices[0].message.content}

    async def main():
        try:
            return await run_agent_episode(agent, {"word": "hi"}, gen, fmt, session="t1-0-0", min_version=0, seed=1,
                                           limits=Limits(max_turns=4, max_new_tokens=6, max_tokens=2000))
        finally:
            await stop_process_gateway()

    traj = run(main(), timeout=100)
    assert traj.finish == "done" and traj.error is None and traj.reward == 0.5 and traj.info["said"] is not None
    out1, out2 = (o.tokens for o in gen.outs)
    prompt = fmt.render([{"role": "user", "content": "Say hi."}], TOOLS)
    env = ([fmt.stop_ids[0]] if gen.outs[0].finish == "length" else []) + fmt.extend(
        [{"role": "user", "content": "Again."}])
    assert traj.tokens == prompt + out1 + env + out2
    assert traj.mask == [False] * len(prompt) + [True] * len(out1) + [False] * len(env) + [True] * len(out2)
    assert [lp for lp, m in zip(traj.logprobs, traj.mask) if m] == gen.outs[0].logprobs + gen.outs[1].logprobs
    assert traj.info["diverged"] == 0 and traj.info["chains"] == 1
    assert (traj.info["temperature"], traj.info["top_p"]) == (gen.outs[0].temperature, gen.outs[0].top_p)  # for the batch
    assert seen[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_wrong_or_missing_key_is_401_and_never_reaches_the_model(tok):
    import aiohttp

    gen = ScriptedGen([spell(tok, "x")])

    async def main():
        gw, client = await serve(gen, HermesFormat(tok))
        try:
            bad = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="not-the-key", max_retries=0, timeout=30)
            with pytest.raises(openai.AuthenticationError) as err:
                await bad.chat.completions.create(model="p", messages=QUESTION)
            await bad.close()
            assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
            url = f"{client.base_url}chat/completions"
            async with aiohttp.ClientSession() as http:
                async with http.post(url, json={"messages": QUESTION}) as r:
                    assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
                async with http.post(url, json={"messages": QUESTION}, headers={"Authorization": "Basic x"}) as r:
                    assert r.status == 401
                other = url.replace("/s/", "/s/0").replace("/chat/", "/chat/")  # an unknown session
                async with http.post(other, json={}, headers={"Authorization": f"Bearer {client.api_key}"}) as r:
                    assert r.status == 404
            return gw.close_session("t0-0-0"), gw.stats()
        finally:
            await client.close()
            await gw.stop()

    traj, stats = run(main())
    assert gen.calls == [] and stats["unauthorized"] == 3 and traj.info["unauthorized"] == 3 and traj.tokens == []


def test_bad_requests_are_400_naming_the_field_and_stream_is_refused(tok):
    gen = ScriptedGen([spell(tok, "x")])

    async def main():
        gw, client = await serve(gen, HermesFormat(tok), max_body_bytes=4096)
        create = client.chat.completions.create
        cases = [
            (dict(messages=[]), "messages"),
            (dict(messages=[{"role": "robot", "content": "hi"}]), "messages[0]"),
            (dict(messages=QUESTION, n=2), "n"),
            (dict(messages=QUESTION, max_tokens=0), "max_tokens"),
            (dict(messages=QUESTION, tools="add"), "tools"),
            (dict(messages=QUESTION, stream=True), "stream"),
        ]
        try:
            for kwargs, param in cases:
                with pytest.raises(openai.BadRequestError) as err:
                    await create(model="p", **kwargs)
                assert err.value.status_code == 400 and err.value.body["param"] == param, (kwargs, err.value.body)
            with pytest.raises(openai.BadRequestError) as err:
                await client.completions.create(model="p", prompt=[1.5, 2])
            assert err.value.body["param"] == "prompt"
            with pytest.raises(openai.APIStatusError) as err:
                await create(model="p", messages=[{"role": "user", "content": "x" * 5000}])
            assert err.value.status_code == 413
            models = await client.models.list()
            assert [m.id for m in models.data] == ["flowrl-policy"]
            return gw.stats()
        finally:
            await client.close()
            await gw.stop()

    stats = run(main())
    assert gen.calls == [] and stats["bad_requests"] == 7


def test_a_service_error_is_503_and_ends_the_episode_as_rollout_error(tok):
    gen = ScriptedGen([], error=ServiceError("replica 2 refused: deadline passed"))

    async def agent(client, task):
        await client.chat.completions.create(model="p", messages=QUESTION)
        return 1.0

    async def main():
        try:
            return await run_agent_episode(agent, {}, gen, HermesFormat(tok), limits=Limits(), session="t2-0-0")
        finally:
            await stop_process_gateway()

    traj = run(main())
    assert traj.finish == "rollout_error" and "replica 2 refused" in traj.error and "503" in traj.error
    assert traj.reward == 0.0 and len(gen.calls) == 1


def test_a_model_call_past_the_request_deadline_is_504_not_a_hang(tok):
    gen = ScriptedGen([spell(tok, "x")])
    gen.block = asyncio.Event()  # never set: the model call does not come back

    async def main():
        gw, client = await serve(gen, HermesFormat(tok), request_timeout_s=0.2)
        try:
            with pytest.raises(openai.APIStatusError) as err:
                await client.chat.completions.create(model="p", messages=QUESTION)
            assert err.value.status_code == 504
            return gw.close_session("t0-0-0")
        finally:
            await client.close()
            await gw.stop()

    traj = run(main())
    assert traj.finish == "rollout_error" and "timed out" in traj.error


def test_the_gateway_listens_on_loopback_only(tok):
    async def main():
        gw, client = await serve(ScriptedGen([]), HermesFormat(tok))
        await client.close()
        try:
            assert gw.address[0] == "127.0.0.1" and gw.root.startswith("http://127.0.0.1:")
            assert str(client.base_url).startswith(gw.root + "/s/")
            outward = _outward_ip()
            if outward is not None:  # the machine's own non-loopback address must refuse
                with pytest.raises(OSError):
                    await asyncio.wait_for(asyncio.open_connection(outward, gw.address[1]), 5)
        finally:
            await gw.stop()

    run(main())


def _outward_ip() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # UDP: no packet is sent, it only picks an interface
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def test_completions_take_token_ids_and_continue_the_chain(tok):
    fmt = HermesFormat(tok)
    out1, out2 = spell(tok, "ab"), spell(tok, "cd", stop=False)
    gen = ScriptedGen([out1, out2, spell(tok, "e")], finish=["stop", "length"])

    async def main():
        gw, client = await serve(gen, fmt)
        try:
            first = [5, 71, 72]
            r = await client.completions.create(model="p", prompt=first, max_tokens=4)
            assert r.choices[0].text == "ab" and r.choices[0].finish_reason == "stop"
            more = first + out1 + [73, 74]
            r = await client.completions.create(model="p", prompt=more)
            assert r.choices[0].text == "cd" and r.choices[0].finish_reason == "length"
            await client.completions.create(model="p", prompt="hello")  # text: encoded, a new chain
            return gw.close_session("t0-0-0"), first, more
        finally:
            await client.close()
            await gw.stop()

    traj, first, more = run(main())
    assert gen.calls[0]["prompt"] == first and gen.calls[0]["max_new_tokens"] == 4
    assert gen.calls[1]["prompt"] == more and gen.calls[2]["prompt"] == tok.encode("hello", add_special_tokens=False)
    assert traj.tokens == more + out2
    assert traj.segments == [("prompt", 3), ("model", len(out1)), ("env", 2), ("model", 2)]
    assert traj.info["chains"] == 2 and traj.info["diverged"] == 1


def test_edited_history_starts_a_new_chain_and_is_counted_as_diverged(tok):
    fmt = HermesFormat(tok)
    turns = [spell(tok, "A long first answer."), spell(tok, "B"), spell(tok, "C")]
    gen = ScriptedGen(turns)

    async def main():
        gw, client = await serve(gen, fmt)
        create = client.chat.completions.create
        try:
            r = await create(model="p", messages=QUESTION)
            # The agent rewrites the model's answer before going on: its ids are not the engine's.
            edited = [*QUESTION, {"role": "assistant", "content": "Edited."}, {"role": "user", "content": "And?"}]
            await create(model="p", messages=edited)
            # A retry of the first call repeats a prefix: it forks, reusing the first prompt's ids.
            await create(model="p", messages=QUESTION)
            assert r.choices[0].message.content == "A long first answer."
            return gw.close_session("t0-0-0"), gw.stats()
        finally:
            await client.close()
            await gw.stop()

    traj, stats = run(main())
    assert fmt.started == [QUESTION, [*QUESTION, {"role": "assistant", "content": "Edited."},
                                      {"role": "user", "content": "And?"}]]
    assert gen.calls[2]["prompt"] == gen.calls[0]["prompt"] == fmt.render(QUESTION)
    assert traj.info == {"chains": 3, "diverged": 1, "forks": 1, "calls": 3, "unauthorized": 0}
    assert stats["diverged"] == 1 and stats["forks"] == 1
    # The longest chain is the edited one: prompt (the whole edited conversation), then "B".
    assert gen.calls[1]["prompt"] == fmt.render(fmt.started[1])
    assert traj.tokens == gen.calls[1]["prompt"] + turns[1]
    assert traj.segments == [("prompt", len(gen.calls[1]["prompt"])), ("model", len(turns[1]))]


def test_a_turn_cut_by_length_is_closed_with_the_stop_token_before_the_next_messages(tok):
    fmt = HermesFormat(tok)
    cut, last = spell(tok, "abc", stop=False), spell(tok, "d")
    gen = ScriptedGen([cut, last], finish=["length", "stop"])

    async def main():
        gw, client = await serve(gen, fmt, max_new_tokens=3)
        try:
            r = await client.chat.completions.create(model="p", messages=QUESTION)
            assert r.choices[0].finish_reason == "length"
            follow = [*QUESTION, r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go"}]
            await client.chat.completions.create(model="p", messages=follow)
            return gw.close_session("t0-0-0")
        finally:
            await client.close()
            await gw.stop()

    traj = run(main())
    env = [fmt.stop_ids[0]] + fmt.extend([{"role": "user", "content": "go"}])
    assert traj.tokens == fmt.render(QUESTION) + cut + env + last and traj.info["diverged"] == 0


def test_run_agent_episode_ends_on_max_turns_deadline_and_agent_errors(tok):
    fmt = HermesFormat(tok)

    async def greedy(client, task):
        for _ in range(3):
            try:
                await client.chat.completions.create(model="p", messages=QUESTION)
            except openai.BadRequestError as e:
                assert e.body["code"] == "max_turns"
                return {"reward": 1.0, "stopped": True}
        return 0.0

    async def stuck(client, task):
        await asyncio.Event().wait()  # never set: only the deadline ends it

    async def broken(client, task):
        raise KeyError("no such tool")

    async def no_reward(client, task):
        return "yes"

    async def main():
        gen = ScriptedGen([spell(tok, "a"), spell(tok, "b")])
        try:
            a = await run_agent_episode(greedy, {}, gen, fmt, limits=Limits(max_turns=2), session="s1", seed=5)
            b = await run_agent_episode(stuck, {}, gen, fmt, limits=Limits(deadline_s=0.2), session="s2")
            c = await run_agent_episode(broken, {}, gen, fmt, limits=Limits(), session="s3")
            d = await run_agent_episode(no_reward, {}, gen, fmt, limits=Limits(), session="s4")
            return a, b, c, d, len(gen.calls)
        finally:
            await stop_process_gateway()

    a, b, c, d, calls = run(main())
    assert (a.finish, a.reward, a.info["stopped"], a.turns, calls) == ("max_turns", 1.0, True, 1, 2)
    assert b.finish == "deadline" and "0.2" in b.error
    assert c.finish == "env_error" and "no such tool" in c.error
    assert d.finish == "env_error" and "'yes'" in d.error


def test_concurrent_calls_of_one_session_each_keep_their_own_chain(tok):
    fmt = HermesFormat(tok)
    turns = {t: spell(tok, t) for t in ("first", "second", "a2", "b2", "c2")}
    gen = ScriptedGen(list(turns.values()))

    async def together(*calls):
        """The calls' model turns start only once all of them reached the model (then none has committed)."""
        gen.block, gen.release_at = asyncio.Event(), len(gen.calls) + len(calls)
        return await asyncio.gather(*calls)

    async def main():
        gw, client = await serve(gen, fmt)
        create = client.chat.completions.create
        try:
            ra, rb = await together(create(model="p", messages=QUESTION), create(model="p", messages=QUESTION))
            answers = [r.choices[0].message for r in (ra, rb)]
            assert {m.content for m in answers} == {"first", "second"}
            go = {"role": "user", "content": "go"}
            follow = [[*QUESTION, m.model_dump(exclude_none=True), go] for m in answers]
            # Both continue the first chain at once: the first to finish extends it, the other forks.
            await together(create(model="p", messages=follow[0]), create(model="p", messages=follow[0]))
            await together(create(model="p", messages=follow[1]))
            return gw.close_session("t0-0-0"), [turns[m.content] for m in answers]  # a: ra's (first or second)
        finally:
            await client.close()
            await gw.stop()

    traj, (a, b) = run(main())
    prompt, env = fmt.render(QUESTION), fmt.extend([{"role": "user", "content": "go"}])
    assert [c["prompt"] for c in gen.calls] == [prompt, prompt, prompt + a + env, prompt + a + env, prompt + b + env]
    assert traj.info["diverged"] == 0 and traj.info["forks"] == 1 and traj.info["chains"] == 3
    second = spell(tok, "second")  # the longer first answer: the longest chain goes on from it
    assert traj.tokens[:len(prompt) + len(second) + len(env)] == prompt + second + env and traj.turns == 2
    assert len(traj.tokens) == len(prompt + second + env) + 3


def test_a_call_past_the_token_budget_is_400_and_ends_the_episode_as_token_budget(tok):
    async def agent(client, task):
        try:
            await client.chat.completions.create(model="p", messages=QUESTION)
        except openai.BadRequestError as e:
            return {"reward": 0.0, "code": e.body["code"]}
        return 1.0

    async def main():
        gen = ScriptedGen([spell(tok, "x")])
        try:
            traj = await run_agent_episode(agent, {}, gen, HermesFormat(tok), limits=Limits(max_tokens=20),
                                           session="s-budget")
            return traj, gen.calls
        finally:
            await stop_process_gateway()

    traj, calls = run(main())
    assert traj.finish == "token_budget" and traj.info["code"] == "token_budget" and calls == []
