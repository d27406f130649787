"""A verifiers environment as a flowrl agent function (the OpenAI-gateway path).

    # my_agents.py -- in a graph: kind: agent, config: {agent: "my_agents:gsm8k"}
    from flowrl.agents.adapters.verifiers import verifiers_agent
    gsm8k = verifiers_agent({"taskset": {"id": "my-taskset"},
                             "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}})

    reward = await gsm8k(client, {"index": 3, "sample": 0, "seed": 7, "ticket": 0})  # client: openai.AsyncOpenAI

A verifiers (0.4, ``verifiers.v1``) environment does not expose ``reset``/``step``: it runs an agent
program (its *harness*) that calls the model itself, through verifiers' own interception server,
and scores the finished trace with the task's ``@vf.reward`` methods. So the adapter is an agent
function ``async fn(client, task) -> reward`` for ``flowrl.agents.openai_agent``: the client it is
handed points at flowrl's gateway (which turns every chat call into token-exact engine turns), and
the adapter hands that endpoint to verifiers as the episode's model:

- the env is built once per process, on the first call: ``vf.SingleAgentEnv(vf.SingleAgentEnvConfig(
  **config))`` from a config mapping, or any ``vf.Env`` (or a zero-argument factory of one);
- ``env.serving()`` (its interception server, shared tool servers) is entered once and held until
  :meth:`VerifiersAgent.aclose`;
- each call runs ``env.run_episode(tasks[task["index"] % len(tasks)], ModelContext(model, client=
  vf.EvalClientConfig(base_url=<gateway>, api_key_var=..., headers=<client's headers>)))`` and
  returns the episode's reward: the sum of its traces' ``trace.reward`` (one trace for a
  single-agent env). A failed episode (``episode.ok`` False) raises :class:`VerifiersEpisodeError`
  with verifiers' own error records, so the runner ends it as an error and not as reward 0.

The gateway's key travels as verifiers expects a key: in an environment variable
(``api_key_var``, set by the adapter before each episode); the client's extra headers (a session
id, say) are sent on every request.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Mapping
from typing import Any

from flowrl.agents.adapters import import_library

API_KEY_VAR = "FLOWRL_GATEWAY_API_KEY"
"""The environment variable verifiers' client reads the gateway's per-run token from."""


class VerifiersEpisodeError(RuntimeError):
    """A verifiers episode that did not finish (its harness, a reward or the model call failed);
    the message carries verifiers' error records."""


class VerifiersAgent:
    """``await agent(client, task) -> float``: one verifiers episode against ``client``'s endpoint.

    ``env``: a config mapping for ``vf.SingleAgentEnvConfig`` (``taskset``, ``agent``: harness and
    runtime, ...), a built ``vf.Env``, or a zero-argument callable returning one. ``model``: the model
    name put in each request (the gateway serves one policy, so any name). ``sampling``: verifiers'
    ``vf.Sampling`` fields for the requests (``temperature``, ``max_tokens``, ...); the gateway may
    override them with the rollout's own settings. All calls must come from one event loop (the
    one the env's servers were started on).
    """

    def __init__(self, env: Mapping[str, Any] | Any | Callable[[], Any], *, model: str = "flowrl",
                 sampling: Mapping[str, Any] | None = None, api_key_var: str = API_KEY_VAR):
        self._spec, self.model, self.api_key_var = env, model, api_key_var
        self._sampling = dict(sampling or {})
        self.env: Any = None
        self.tasks: list[Any] = []
        self._stack: contextlib.AsyncExitStack | None = None
        self._lock: asyncio.Lock | None = None

    def _build(self) -> Any:
        vf = import_library("verifiers.v1", "verifiers>=0.4", "verifiers_agent")
        spec = self._spec
        if isinstance(spec, Mapping):
            env = vf.SingleAgentEnv(vf.SingleAgentEnvConfig(**spec))
        elif isinstance(spec, vf.Env):
            env = spec
        elif callable(spec):
            env = spec()
        else:
            raise TypeError(f"verifiers_agent takes a vf.SingleAgentEnvConfig mapping, a vf.Env or a "
                            f"factory of one; got {type(spec).__name__}")
        if not isinstance(env, vf.Env):
            raise TypeError(f"verifiers_agent: the factory returned {type(env).__name__}, not a vf.Env")
        if not env.taskset.bounded:
            raise ValueError(f"verifiers_agent: taskset {type(env.taskset).__name__} is infinite; bound it "
                             "(taskset.take(n)) so a task index names one task")
        self.tasks = list(env.taskset)
        if not self.tasks:
            raise ValueError(f"verifiers_agent: taskset {type(env.taskset).__name__} yielded no task")
        return env

    async def _start(self) -> None:
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            if self._stack is None:
                env = self._build()
                stack = contextlib.AsyncExitStack()
                await stack.enter_async_context(env.serving())
                self.env, self._stack = env, stack

    async def __call__(self, client: Any, task: Mapping[str, Any]) -> float:
        if self._stack is None:
            await self._start()
        vf = import_library("verifiers.v1", "verifiers>=0.4", "verifiers_agent")
        os.environ[self.api_key_var] = client.api_key or "EMPTY"
        headers = {k: v for k, v in dict(getattr(client, "_custom_headers", {}) or {}).items()
                   if isinstance(v, str) and k.lower() != "authorization"}
        endpoint = vf.EvalClientConfig(base_url=str(client.base_url).rstrip("/"), api_key_var=self.api_key_var,
                                       headers=headers)
        ctx = vf.ModelContext(model=self.model, client=endpoint, sampling=vf.Sampling(**self._sampling))
        vtask = self.tasks[int(task.get("index", 0)) % len(self.tasks)]
        episode = await self.env.run_episode(vtask, ctx)
        if not episode.ok:
            errors = list(episode.errors) + [e for t in episode.traces for e in (getattr(t, "errors", None) or [])]
            detail = "; ".join(f"{e.type}: {e.message}" for e in errors) or "no error recorded"
            raise VerifiersEpisodeError(f"verifiers episode for task {vtask.data.idx} failed: {detail}")
        return float(sum(t.reward for t in episode.traces))

    async def aclose(self) -> None:
        """Stop the env's servers (the interception server, shared tools); safe to call twice."""
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()


def verifiers_agent(env: Mapping[str, Any] | Any | Callable[[], Any], **kwargs: Any) -> VerifiersAgent:
    """The agent function for a verifiers environment (see :class:`VerifiersAgent` for the options)."""
    return VerifiersAgent(env, **kwargs)
