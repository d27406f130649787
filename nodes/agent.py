"""Agent: runs each ticket's episodes (B tasks x n samples) against an environment, all at once.

    nodes:
      agent:
        kind: agent
        config: {env: calc, model: *model, samples_per_prompt: 8, max_turns: 4, max_tokens: 64}
    services: [agent -> rollout]       # the model's turns: requests to the rollout replicas

A source: ticket i's tasks are ``i * size .. i * size + size - 1``; every sample of a task gets
the same task seed (one problem per GRPO group), every episode its own sampling seed, both pure
functions of (run seed, task index, sample), so a replayed ticket plays the same episodes. An
episode alternates model turns (``ctx.services[service]``, a ``flowrl.agents.Generator``) and
environment or tool turns (``flowrl.agents.episode.run_episode``); its session id
``"<batch_id>:<attempt>:<episode>"`` keeps its requests on one replica (prefix cache) and keys the
tool journal. The batch is the rollout's ragged layout with whole episodes as samples (loss mask
on the model's tokens only, see ``flowrl.agents.batch``), so ``agent -> group_advantages ->
actor`` trains on it unchanged.

``env`` is a built-in environment (``calc``, ``guess``: ``flowrl.agents.envs``) or
``"pkg.mod:Class"`` (one instance per episode, ``Class(**env_config)``). Instead of an env,
``agent: "pkg.mod:async_fn"`` runs plain agent code against the OpenAI-compatible gateway
(``flowrl.agents.openai_agent``). Metrics: ``episodes``, ``episodes_<finish>``, ``episode_turns``,
``episode_tool_calls``, ``tool_errors``, ``env_step_s``, ``episode_s``, ``episode_reward``, and one
trace span per episode and per turn.
"""

from __future__ import annotations

from pydantic import Field, model_validator

import flowrl
from flowrl.nodes.common import ModelConfig


class Agent(flowrl.Source):
    role = None  # no placement rules: it holds no model (a CPU process is enough)

    class Config(ModelConfig):
        env: str | None = None
        """The environment: a built-in name (``calc``, ``guess``) or ``"pkg.mod:Class"``."""
        env_config: dict = Field(default_factory=dict)
        """Keyword arguments of the environment's class."""
        agent: str | None = None
        """Instead of ``env``: plain async agent code ``"pkg.mod:async_fn"`` run through the gateway."""
        service: str = "rollout"
        """The service (``services: [agent -> rollout]``) whose replicas generate the model's turns."""
        samples_per_prompt: int = Field(4, ge=1)
        """Episodes per task (GRPO's group size)."""
        max_turns: int = Field(8, ge=1)
        """Model turns per episode at most (tool-calling turns count)."""
        max_tokens: int | None = Field(None, ge=2)
        """Tokens of a whole episode at most (prompt, model, environment, tools); None: the model's
        context (``max_seq_len`` of the built-in model; 4096 for a Hugging Face model)."""
        max_new_tokens: int = Field(64, ge=1)
        """Tokens of one model turn at most (capped further by what ``max_tokens`` leaves)."""
        episode_timeout_s: float | None = Field(300.0, gt=0)
        """Wall-clock deadline of one episode; past it the episode ends as ``deadline``."""
        request_timeout_s: float | None = Field(None, gt=0)
        """Deadline of one generation request (None: the service's default)."""
        tools: list[str] | None = None
        """Tools the model may call (``calc``, ``python``, ``"pkg.mod:fn"``); None: the environment's own
        (its ``tools`` attribute), [] none."""
        tool_timeout_s: float = Field(30.0, gt=0)
        """Deadline of one tool call (its result is then an error message; the episode goes on)."""
        error_reward: float = 0.0
        """Reward of an episode that ended on an error (env, rollout) or at its deadline."""
        temperature: float | None = Field(None, ge=0)
        """What the model's turns were sampled at: None (the way to write graphs) takes the rollout's
        setting, which every answer carries; a value that differs from it is an error, never two
        temperatures in one run. Carried in the batch to the trainer."""
        top_p: float | None = Field(None, gt=0, le=1)
        """Nucleus mass, as `temperature`: None takes the rollout's."""
        record_trajectories: bool = False
        """Write every episode it emits (session, token ids, loss mask, finish, reward) to
        `RUN_DIR/trajectories/<node>.<replica>.jsonl`, for `flowrl.agents.exact.check_run`."""

        @model_validator(mode="after")
        def _env_or_agent(self):
            if (self.env is None) == (self.agent is None):
                raise ValueError("give the agent node exactly one of `env` (an environment: calc, guess or "
                                 "'pkg.mod:Class') and `agent` (async agent code 'pkg.mod:async_fn')")
            return self

    async def setup(self):
        from flowrl.agents.chat import chat_format
        from flowrl.agents.episode import EpisodeLimits
        from flowrl.agents.tools import ToolJournal, Tools
        from flowrl.agents.envs import resolve_env

        cfg = self.config
        context = getattr(cfg.model, "max_seq_len", None)
        max_tokens = cfg.max_tokens or context or 4096
        if context is not None and max_tokens > context:
            raise ValueError(f"node `{self.ctx.name}`: max_tokens={cfg.max_tokens} is more than the model's context of "
                             f"{context} tokens (model.max_seq_len); lower max_tokens or raise max_seq_len of every "
                             "node's model (a YAML anchor)")
        self.fmt = chat_format(cfg.model)
        self.env_cls = resolve_env(cfg.env) if cfg.env else None
        if self.env_cls is not None:
            self.env_cls(**cfg.env_config)  # a bad env_config fails here, at start, not in every episode
        names = cfg.tools if cfg.tools is not None else list(getattr(self.env_cls, "tools", ()))
        self.tools = Tools(names, timeout_s=cfg.tool_timeout_s)
        self.limits = EpisodeLimits(max_turns=cfg.max_turns, max_tokens=max_tokens,
                                    deadline_s=cfg.episode_timeout_s, request_timeout_s=cfg.request_timeout_s,
                                    error_reward=cfg.error_reward, max_new_tokens=cfg.max_new_tokens)
        run_dir = self.ctx.run_dir
        self.journal = ToolJournal(run_dir / "journal" / f"{self.ctx.name}.jsonl" if run_dir else None)
        self.agent_fn = None
        if cfg.agent:
            import importlib

            module, _, attr = cfg.agent.partition(":")
            self.agent_fn = getattr(importlib.import_module(module), attr, None)
            if not callable(self.agent_fn):
                raise ValueError(f"node `{self.ctx.name}`: agent {cfg.agent!r} is not an async function "
                                 "'package.module:function'")

    def generator(self):
        services = getattr(self.ctx, "services", None) or {}
        gen = services.get(self.config.service)
        if gen is None:
            raise ValueError(f"node `{self.ctx.name}` generates through service {self.config.service!r}, but the "
                             f"graph gives it {sorted(services) or 'no services'}; add `services: "
                             f"[{self.ctx.name} -> {self.config.service}]` to the graph")
        return gen

    def task(self, ticket, i: int, sample: int) -> tuple[dict, int]:
        """Task ``i`` of the ticket as its ``sample``-th episode sees it, and the episode's seed."""
        index = ticket.index * ticket.size + i
        task = {"index": index, "sample": sample, "seed": self.ctx.seed, "ticket": ticket.batch_id}
        return task, (self.ctx.seed * 1_000_003 + index) * 1009 + sample

    async def generate(self, ticket):
        import asyncio

        from flowrl.agents.batch import trajectories_to_batch

        cfg, n, gen = self.config, self.config.samples_per_prompt, self.generator()
        episodes = []
        for i in range(ticket.size):
            for s in range(n):
                task, seed = self.task(ticket, i, s)
                session = f"{ticket.batch_id}:{ticket.attempt}:{i * n + s}"
                episodes.append(self.episode(task, gen, session, ticket.min_policy_version, seed))
        trajs = await asyncio.gather(*episodes)
        self.record(trajs, session_prefix=ticket.batch_id)
        if cfg.record_trajectories:
            self.write_trajectories(trajs, [f"{ticket.batch_id}:{ticket.attempt}:{e}" for e in range(len(trajs))])
        batch = trajectories_to_batch(trajs, n, cfg.temperature, cfg.top_p,
                                      {"agent_env": cfg.env or cfg.agent, "tokenizer": self.fmt_tokenizer()},
                                      default_version=ticket.min_policy_version, filler=self.fmt.stop_ids[0])
        for key in ("temperature", "top_p"):  # the rollout's setting came with every answer: one setting
            mine = getattr(cfg, key)
            if mine is not None and float(mine) != batch.meta[key]:
                raise ValueError(f"node `{self.ctx.name}` sets {key}={mine}, but the rollout sampled at "
                                 f"{key}={batch.meta[key]} (nodes.rollout.config.{key}); delete it from the agent's "
                                 "config: it comes with every answer")
        return batch

    async def episode(self, task, gen, session, min_version, seed):
        cfg = self.config
        if self.agent_fn is not None:
            from flowrl.agents.openai_agent import run_agent_episode

            return await run_agent_episode(self.agent_fn, task, gen, self.fmt, limits=self.limits, session=session,
                                           min_version=min_version, seed=seed)
        from flowrl.agents.episode import run_episode

        return await run_episode(self.env_cls(**cfg.env_config), task, gen, self.fmt, limits=self.limits,
                                 tools=self.tools or None, session=session, min_version=min_version, seed=seed,
                                 max_new_tokens=cfg.max_new_tokens, journal=self.journal)

    def write_trajectories(self, trajs, sessions) -> None:
        import json

        if self.ctx.run_dir is None:
            return
        folder = self.ctx.run_dir / "trajectories"
        folder.mkdir(exist_ok=True)
        with open(folder / f"{self.ctx.name}.{self.ctx.replica}.jsonl", "a") as f:
            for t, session in zip(trajs, sessions):
                f.write(json.dumps({"session": session, "tokens": t.tokens, "mask": t.mask, "finish": t.finish,
                                    "reward": t.reward}) + "\n")

    def fmt_tokenizer(self) -> dict:
        from flowrl.data import tokenizer_for

        return tokenizer_for(self.config.model).spec

    def record(self, trajs, session_prefix: str = "") -> None:
        rec = self.ctx.recorder
        if rec is None:
            return
        rec.count("episodes", len(trajs))
        for k, t in enumerate(trajs):
            rec.count(f"episodes_{t.finish}")
            rec.observe("episode_turns", t.turns, buckets=[1, 2, 3, 4, 6, 8, 12, 16, 32, 64])
            rec.observe("episode_tool_calls", t.tool_calls, buckets=[0, 1, 2, 3, 4, 6, 8, 16, 32])
            rec.count("tool_errors", t.info.get("tool_errors", 0))
            rec.mean("episode_reward", t.reward)
            rec.count("agent_model_tokens", sum(t.mask))
            for s in t.info.get("env_step_s", ()):
                rec.observe("env_step_s", s)
            if "seconds" in t.info:
                rec.observe("episode_s", t.info["seconds"])
            if hasattr(rec, "add_span") and "start_s" in t.info:
                start = t.info["start_s"]
                rec.add_span("episode", start, t.info.get("seconds", 0.0), episode=k, finish=t.finish,
                             turns=t.turns, ticket=session_prefix)
                for turn, (at, sec) in enumerate(t.info.get("turn_s", ())):
                    rec.add_span("turn", at, sec, episode=k, turn=turn)

