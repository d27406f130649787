"""One episode: model turns and environment turns until the environment is done or a limit ends it.

    >>> traj = await run_episode(env, {"index": 3, "sample": 0, "seed": 7}, gen, fmt,
    ...                          limits=EpisodeLimits(max_turns=4, max_tokens=96, deadline_s=30),
    ...                          tools=Tools(["calc"]), session="b0:0:3", min_version=0, seed=7,
    ...                          max_new_tokens=16)                                     # doctest: +SKIP
    >>> traj.finish, traj.reward, traj.turns, traj.tool_calls                            # doctest: +SKIP
    ('done', 1.0, 2, 1)

The loop: ``env.reset(task)`` gives the first messages, ``fmt.start`` their ids (segment
``prompt``). Then, each turn: the generator continues the whole token list so far, and its tokens
are appended exactly as they came (segment ``model``: mask True, the engine's log-probs and
versions); the turn's text goes to the tools when it holds tool calls and tools are given (each
call's result is a ``tool`` message, segment ``tool``), else to ``env.step`` (its messages are
segment ``env``); ``fmt.extend`` gives the new messages' ids. Nothing is re-tokenized, so every
trajectory holds ``len(tokens) == len(mask) == len(logprobs) == len(versions)``, mask True
exactly on model tokens, versions -1 and log-probs 0 everywhere else.

How it ends (``Trajectory.finish``) and its reward:

==============  =====================================================  ==========================
finish          when                                                   reward
==============  =====================================================  ==========================
done            ``env.step`` returned ``done=True``                    sum of the turn rewards
max_turns       ``limits.max_turns`` model turns were taken            sum of the turn rewards
token_budget    ``limits.max_tokens`` would be passed (each turn's     sum of the turn rewards
                ``max_new_tokens`` is capped to what is left, and an
                environment message that does not fit ends it)
deadline        ``limits.deadline_s`` passed (a hanging env or tool)   ``limits.error_reward``
env_error       ``env.reset`` or ``env.step`` raised (``error``)       ``limits.error_reward``
rollout_error   the generator raised ``ServiceError`` (``error``)      ``limits.error_reward``
==============  =====================================================  ==========================

Errors are not the policy's doing, so they get a fixed reward rather than a partial sum (the node
records them by finish so a run can tell a bad env from a bad policy). A tool that fails or times
out does not end the episode (see ``flowrl.agents.tools``).

``Trajectory.info`` holds what the node records: ``env_step_s`` (seconds of each ``env.step``),
``turn_s`` ((wall-clock start, seconds) of each turn), ``tool_errors``, ``start_s`` (wall clock),
``seconds`` (the whole episode), ``env_info`` (each step's ``info``), and ``temperature`` /
``top_p``: what the generator says it sampled at (the rollout's setting; it travels in the batch).

Environments may be sync or ``async``; a sync ``reset``/``step`` runs in a worker thread so a slow
environment never holds up the other episodes of the ticket (a hung one is left behind at the
deadline: threads cannot be stopped). An environment may also define ``on_tools(calls, results)``
(sync or async) -> float: called after each turn of tool calls with the calls and their
:class:`~flowrl.agents.tools.ToolResult`\\ s, its value is that turn's reward -- how a task shapes
the reward of calling a tool well (the built-in ``calc`` task does); and
``prepare_call(call) -> ToolCall``, given each parsed call before it runs, to bind it to the
episode's state (the ``calc`` task fills in an empty expression with its question).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from dataclasses import dataclass
from typing import Any

from flowrl.agents.base import ChatFormat, Env, Generator, ServiceError, Trajectory
from flowrl.agents.threads import in_thread
from flowrl.agents.tools import ToolContext, ToolJournal, Tools


@dataclass(frozen=True)
class EpisodeLimits:
    """What bounds an episode (the agent node's config fills it)."""

    max_turns: int = 8
    """Model turns at most (tool-calling turns count)."""
    max_tokens: int = 512
    """Tokens of the whole trajectory at most (prompt, model, env and tool tokens)."""
    deadline_s: float | None = 300.0
    """Wall-clock seconds for the whole episode (None: no deadline)."""
    request_timeout_s: float | None = None
    """Bound of one generation request (None: the service's default); never past the deadline."""
    error_reward: float = 0.0
    """The reward of an episode that ended on an error or at the deadline."""
    max_new_tokens: int = 64
    """Tokens of one model turn at most (agent code through the gateway: a call's max_tokens can only
    lower it; environments: `run_episode`'s own argument)."""


async def call(fn, *args: Any) -> Any:
    """``fn(*args)``: awaited when async, else run in a thread of its own (``flowrl.agents.threads``)."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    out = await in_thread(fn, *args)
    return await out if inspect.isawaitable(out) else out


async def run_episode(env: Env, task: dict[str, Any], gen: Generator, fmt: ChatFormat, *,
                      limits: EpisodeLimits = EpisodeLimits(), tools: Tools | None = None, session: str = "",
                      min_version: int = 0, seed: int = 0, max_new_tokens: int = 64,
                      journal: ToolJournal | None = None) -> Trajectory:
    """Run one episode of ``env`` on ``task``; see the module docstring. Never raises for an
    environment, tool or generator failure: the trajectory says how it ended."""
    traj = Trajectory()
    traj.info.update(env_step_s=[], turn_s=[], tool_errors=0, start_s=time.time())
    t0 = time.perf_counter()
    try:
        if limits.deadline_s is None:
            await _loop(traj, env, task, gen, fmt, limits, tools, session, min_version, seed, max_new_tokens,
                        journal, None, t0)
        else:
            end = t0 + limits.deadline_s
            async with asyncio.timeout(limits.deadline_s):
                await _loop(traj, env, task, gen, fmt, limits, tools, session, min_version, seed, max_new_tokens,
                            journal, end, t0)
    except TimeoutError:
        _fail(traj, "deadline", f"the episode passed its deadline of {limits.deadline_s:g}s", limits)
    except ServiceError as e:
        _fail(traj, "rollout_error", str(e), limits)
    except _EnvError as e:
        _fail(traj, "env_error", str(e), limits)
    traj.info["seconds"] = time.perf_counter() - t0
    _check(traj)
    return traj


class _EnvError(Exception):
    pass


def _fail(traj: Trajectory, finish: str, error: str, limits: EpisodeLimits) -> None:
    traj.finish, traj.error, traj.reward = finish, error, limits.error_reward


def _append(traj: Trajectory, kind: str, ids: list[int]) -> None:
    if not ids:
        return
    traj.tokens += ids
    traj.mask += [False] * len(ids)
    traj.logprobs += [0.0] * len(ids)
    traj.versions += [-1] * len(ids)
    traj.segments.append((kind, len(ids)))


async def _env(fn, *args: Any) -> Any:
    try:
        return await call(fn, *args)
    except (asyncio.CancelledError, TimeoutError):
        raise
    except Exception as e:  # noqa: BLE001 - the env's bug ends this episode, not the ticket
        name = getattr(fn, "__qualname__", getattr(fn, "__name__", "env"))
        raise _EnvError(f"{name} raised {type(e).__name__}: {e}") from e


def _messages(out: Any) -> list[dict[str, Any]]:
    if isinstance(out, str):
        return [{"role": "user", "content": out}]
    return list(out or [])


async def _loop(traj: Trajectory, env: Env, task: dict[str, Any], gen: Generator, fmt: ChatFormat,
                limits: EpisodeLimits, tools: Tools | None, session: str, min_version: int, seed: int,
                max_new_tokens: int, journal: ToolJournal | None, end: float | None, t0: float) -> None:
    first = _messages(await _env(env.reset, task))
    _append(traj, "prompt", list(fmt.start(first, tools.specs() if tools else None)))
    traj.prompt_len = len(traj.tokens)
    journal = journal if journal is not None else ToolJournal()
    total = 0.0
    while True:
        if traj.turns >= limits.max_turns:
            traj.finish = "max_turns"
            break
        room = limits.max_tokens - len(traj.tokens)
        if room < 1:
            traj.finish = "token_budget"
            break
        timeout = limits.request_timeout_s
        if end is not None:
            left = max(end - time.perf_counter(), 1e-3)
            timeout = left if timeout is None else min(timeout, left)
        t_turn = time.perf_counter()
        out = await gen.complete(list(traj.tokens), session=session, max_new_tokens=min(max_new_tokens, room),
                                 stop=tuple(fmt.stop_ids), min_version=min_version,
                                 seed=seed * 1_000_003 + traj.turns, timeout_s=timeout)
        if not (len(out.tokens) == len(out.logprobs) == len(out.versions)):
            raise ServiceError(f"a completion of {len(out.tokens)} tokens came with {len(out.logprobs)} log-probs "
                               f"and {len(out.versions)} versions")
        toks = [int(t) for t in out.tokens][:room]
        traj.tokens += toks
        traj.mask += [True] * len(toks)
        traj.logprobs += [float(x) for x in out.logprobs[: len(toks)]]
        traj.versions += [int(v) for v in out.versions[: len(toks)]]
        traj.segments.append(("model", len(toks)))
        traj.info["temperature"], traj.info["top_p"] = out.temperature, out.top_p  # what the service sampled at
        traj.turns += 1
        text = fmt.text(toks)
        calls = fmt.tool_calls(text) if tools else []
        if calls:
            results = []
            if hasattr(env, "prepare_call"):
                calls = [env.prepare_call(c) for c in calls]
            for i, c in enumerate(calls):
                ctx = ToolContext.for_session(session, traj.turns - 1, journal, i)
                results.append(await tools.run(c, ctx))
            traj.tool_calls += len(calls)
            traj.info["tool_errors"] += sum(not r.ok for r in results)
            reward = 0.0
            if hasattr(env, "on_tools"):
                reward = float(await _env(env.on_tools, calls, results) or 0.0)
            new, kind, done = [r.message(c) for c, r in zip(calls, results)], "tool", False
        else:
            t_env = time.perf_counter()
            step = await _env(env.step, text)
            traj.info["env_step_s"].append(time.perf_counter() - t_env)
            reward, new, kind, done = float(step.reward), _messages(step.messages), "env", bool(step.done)
            if step.info:
                traj.info.setdefault("env_info", []).append(step.info)
        traj.turn_rewards.append(reward)
        total += reward
        traj.reward = total
        traj.info["turn_s"].append((traj.info["start_s"] + (t_turn - t0), time.perf_counter() - t_turn))
        if done:
            traj.finish = "done"
            break
        if len(traj.tokens) >= limits.max_tokens:
            traj.finish = "token_budget"
            break
        ids = list(fmt.extend(new)) if new else []
        if len(traj.tokens) + len(ids) >= limits.max_tokens:
            traj.finish = "token_budget"  # the messages would leave no room for the model's answer
            break
        _append(traj, kind, ids)


def _check(traj: Trajectory) -> None:
    n = len(traj.tokens)
    assert len(traj.mask) == len(traj.logprobs) == len(traj.versions) == n, "trajectory tensors out of line"
    assert sum(k for _, k in traj.segments) == n, "segments do not cover the tokens"
