"""Agents written as plain async code against the official ``openai`` client.

    async def agent(client: openai.AsyncOpenAI, task: dict) -> float:
        r = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": ...}],
                                                 tools=TOOLS)
        ...                                             # run the tools, call again with their results
        return 1.0 if solved else 0.0                   # or {"reward": r, **info}

    traj = await run_agent_episode(agent, task, gen, fmt, limits=Limits(max_turns=8), session="t3-0-1",
                                   min_version=7, seed=123)

The client is pointed at the process's :class:`~flowrl.agents.gateway.Gateway` (one per process,
started on the running loop when the first episode needs it), with the episode's own ``base_url``
and key. The agent code never sees token ids, log-probs or versions; the gateway keeps them, and
the episode's :class:`~flowrl.agents.base.Trajectory` is the one its session built, with the
reward the code returned. Sampling settings the code passes (temperature, top_p) are ignored: they
are the rollout's.

How an episode ends (``Trajectory.finish``): ``done`` (the code returned); ``max_turns`` /
``token_budget`` (a call past the limit got a 400; the code may still return a reward, which is
kept); ``rollout_error`` (a model call failed: 503/504 to the code); ``deadline`` (the code ran
past ``limits.deadline_s`` and was cancelled); ``env_error`` (the code raised, or returned no
number). A limit or rollout error recorded by the gateway is the reason even when the code then
raised on the error response it got.
"""

from __future__ import annotations

import asyncio
import math
import numbers
from collections.abc import Awaitable, Callable
from typing import Any

from flowrl.agents.base import ChatFormat, Generator, Trajectory
from flowrl.agents.episode import EpisodeLimits
from flowrl.agents.gateway import Gateway

AgentFn = Callable[[Any, dict[str, Any]], Awaitable["float | dict[str, Any]"]]
"""``async def agent(client: openai.AsyncOpenAI, task: dict) -> float | {"reward": float, ...}``."""


Limits = EpisodeLimits
"""What bounds one episode: the agent node's `EpisodeLimits` (max_turns, max_tokens, deadline_s,
max_new_tokens are read here)."""


class _Process:
    """The process's gateway, bound to the loop it was started on (a new loop gets a new one)."""

    loop: asyncio.AbstractEventLoop | None = None
    gateway: Gateway | None = None
    ready: asyncio.Future | None = None


async def process_gateway() -> Gateway:
    """The gateway of this process on the running loop, started on first use."""
    loop = asyncio.get_running_loop()
    if _Process.loop is not loop or _Process.gateway is None:
        gateway = Gateway()
        _Process.loop, _Process.gateway, _Process.ready = loop, gateway, loop.create_task(gateway.start())
    assert _Process.ready is not None and _Process.gateway is not None
    await asyncio.shield(_Process.ready)
    return _Process.gateway


async def stop_process_gateway() -> None:
    """Stop the process's gateway (a node's teardown; tests). The next episode starts a new one."""
    gateway, loop = _Process.gateway, _Process.loop
    _Process.loop = _Process.gateway = _Process.ready = None
    if gateway is not None and loop is asyncio.get_running_loop():
        await gateway.stop()


def _reward(result: Any) -> tuple[float, dict[str, Any]]:
    info: dict[str, Any] = {}
    if isinstance(result, dict):
        if "reward" not in result:
            raise ValueError(f"the agent returned a dict without 'reward' (keys: {sorted(result)}); "
                             "return a number or {'reward': r, ...}")
        info = {k: v for k, v in result.items() if k != "reward"}
        result = result["reward"]
    if isinstance(result, bool) or not isinstance(result, numbers.Real) or not math.isfinite(result):
        raise ValueError(f"the agent returned reward {result!r}; return a finite number or {{'reward': r, ...}}")
    return float(result), info


async def run_agent_episode(fn: AgentFn, task: dict[str, Any], gen: Generator, fmt: ChatFormat, *, limits: Any,
                            session: str, min_version: int = 0, seed: int = 0) -> Trajectory:
    """Run ``fn(client, task)`` as one episode (see the module docstring); never raises for the
    agent code's errors -- they end the episode (``finish``, ``error``). ``limits`` has
    ``max_turns``, ``max_tokens``, ``deadline_s`` and ``max_new_tokens`` (:class:`Limits`)."""
    import openai

    gateway = await process_gateway()
    base_url, key = gateway.open_session(
        session, gen, fmt, min_version=min_version, seed=seed, max_new_tokens=int(limits.max_new_tokens),
        max_tokens=int(limits.max_tokens), max_turns=int(limits.max_turns))
    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0,
                                timeout=min(_deadline(limits), gateway.request_timeout_s + 5.0))
    reward, info, finish, error = 0.0, {}, "done", None
    try:
        result = await asyncio.wait_for(fn(client, dict(task)), timeout=_deadline(limits))
        reward, info = _reward(result)
    except asyncio.TimeoutError:
        finish, error = "deadline", f"the agent ran past its deadline of {_deadline(limits)}s"
    except Exception as e:  # noqa: BLE001 - the agent code's failure ends its episode, not the node
        finish, error = "env_error", f"{type(e).__name__}: {e}"
    finally:
        try:
            if finish != "done":
                gateway.end_session(session, finish, error)
            sampled = gateway.sampled(session)  # the batch's temperature and top_p, as for environments
            traj = gateway.close_session(session)
        finally:
            await client.close()
    if finish in ("deadline", "env_error") and traj.finish not in ("done", finish):
        traj.error = f"{traj.error}; then {error}" if traj.error else error  # the gateway's reason comes first
    traj.reward = reward
    traj.info.update(info)
    traj.info.update(sampled)
    return traj


def _deadline(limits) -> float:
    return float(limits.deadline_s) if limits.deadline_s is not None else 1e9
