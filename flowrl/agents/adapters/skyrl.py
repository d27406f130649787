"""SkyRL-Gym text environments as flowrl agent environments.

    env = SkyRLEnv("gsm8k", tasks=[{"prompt": [{"role": "user", "content": "2+3? End with #### N"}],
                                    "reward_spec": {"method": "rule", "ground_truth": "5"}}])
    await env.reset({"index": 0, "sample": 0, "seed": 1, "ticket": 0})   # -> the row's prompt
    await env.step("2+3 is 5. #### 5")     # -> Step(messages=[], reward=1.0, done=True, info={})

In a graph: ``kind: agent, config: {env: "flowrl.agents.adapters.skyrl:SkyRLEnv", env_config:
{env_id: gsm8k, tasks: data/train.parquet}}``.

The mapping. A SkyRL-Gym env is built per episode from one dataset row, exactly as SkyRL-train's
generator does it: ``skyrl_gym.make(env_class, env_config=..., extras=row)`` where ``extras`` is the
row without ``prompt`` and ``env_class`` (so ``reward_spec``, ``extra_info``, ``max_turns``, ``db_id``
... reach the env), then ``env.init(row["prompt"]) -> (messages, info)`` gives the first messages and
each ``env.step(text) -> BaseTextEnvStepOutput(observations, reward, done, metadata)`` becomes a
:class:`~flowrl.agents.base.Step` (observations are already chat messages). The row is
``tasks[task["index"] % len(tasks)]``: every sample of a task, and a replayed ticket, meets the same
row (SkyRL-Gym envs draw nothing at random). When the episode ends the env is closed and its
``get_metrics()`` lands in the last step's ``info``.

What does not carry over: SkyRL's ``postprocessed_action`` (the env's rewrite of the model's turn,
e.g. cut after ``</sql>``) cannot replace tokens the model generated -- flowrl keeps them as
generated -- so it is only reported in ``info["postprocessed_action"]``.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from flowrl.agents.adapters import import_library, some
from flowrl.agents.base import Step
from flowrl.agents.threads import in_thread

_NOT_EXTRAS = ("prompt", "env_class")


class SkyRLEnv:
    """One SkyRL-Gym episode at a time over a list of SkyRL dataset rows.

    ``env_id``: a registered SkyRL-Gym id (``gsm8k``, ``gsm8k_multi_turn``, ``aime``, ``text2sql``,
    ``search``, ``lcb``, ...) or ``"pkg.module:EnvClass"`` for an env of your own; a row's own
    ``env_class`` wins over it, as in SkyRL-train. ``tasks``: the rows (dicts with ``prompt``, a list of
    chat messages or a string, plus the env's extras), or a path to a ``.jsonl``, ``.json`` or
    ``.parquet`` file of them. ``env_config``: the env's config section (SkyRL's
    ``skyrl_gym.<env_class>``: ``text2sql`` reads ``db_path``, ``search`` reads ``search_url``); given to
    the env as an omegaconf ``DictConfig``, as SkyRL-train does. ``reset`` and ``step`` run the
    library's calls in a worker thread: tool envs execute SQL, code or HTTP requests there.
    """

    def __init__(self, env_id: str | None = None, tasks: Sequence[Mapping[str, Any]] | str | None = None,
                 env_config: Mapping[str, Any] | None = None):
        self._gym = import_library("skyrl_gym", "skyrl-gym", "SkyRLEnv")
        omegaconf = import_library("omegaconf", "omegaconf", "SkyRLEnv")
        if tasks is None:
            raise ValueError("SkyRLEnv needs tasks: a list of SkyRL dataset rows ({prompt: [...], "
                             "reward_spec: {...}, ...}) or the path of a .jsonl/.json/.parquet file of them")
        self.tasks = _load_rows(tasks) if isinstance(tasks, (str, os.PathLike)) else [dict(r) for r in tasks]
        if not self.tasks:
            raise ValueError(f"SkyRLEnv got no task rows from {tasks!r}")
        self.env_id = env_id
        if env_id is not None:
            self._creator(env_id)                     # an unknown id fails when the node starts
        elif any("env_class" not in r for r in self.tasks):
            raise ValueError("SkyRLEnv needs env_id (e.g. gsm8k) when a task row has no env_class")
        self.env_config = omegaconf.DictConfig(dict(env_config or {}))
        self.env: Any = None
        self.row: dict[str, Any] | None = None

    def _creator(self, env_id: str):
        """What builds ``env_id``: the registry's entry point, or an imported ``pkg.mod:Class``."""
        spec = self._gym.registry.get(env_id)
        if spec is not None:
            return functools.partial(self._gym.make, env_id)
        if ":" in env_id:
            module, _, name = env_id.partition(":")
            try:
                return getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError) as e:
                raise ValueError(f"SkyRLEnv: cannot load env class {env_id!r}: {e}") from e
        raise ValueError(f"SkyRLEnv: unknown skyrl-gym env id {env_id!r}; registered ids: "
                         f"{some(self._gym.registry)}; or give 'pkg.module:EnvClass' for an env of your own")

    def _make(self, row: dict[str, Any]) -> Any:
        env_id = row.get("env_class") or self.env_id
        extras = {k: v for k, v in row.items() if k not in _NOT_EXTRAS}
        return self._creator(env_id)(env_config=self.env_config, extras=extras)

    async def reset(self, task: Mapping[str, Any]) -> list[dict[str, Any]]:
        self.close()
        self.row = self.tasks[int(task.get("index", 0)) % len(self.tasks)]
        prompt = self.row.get("prompt")
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if not prompt:
            raise ValueError(f"SkyRLEnv: task row {int(task.get('index', 0)) % len(self.tasks)} has no prompt")

        def start():
            self.env = self._make(self.row)
            return self.env.init([dict(m) for m in prompt])

        messages, _info = await in_thread(start)
        return [dict(m) for m in messages]

    async def step(self, text: str) -> Step:
        if self.env is None:
            raise RuntimeError("SkyRLEnv.step before reset")
        out = await in_thread(self.env.step, text)
        done = bool(out["done"])
        info = dict(out.get("metadata") or {})
        if out.get("postprocessed_action") is not None:
            info["postprocessed_action"] = out["postprocessed_action"]
        if done:
            info.update(self.env.get_metrics() or {})
            self.close()
        return Step(messages=[dict(m) for m in out.get("observations") or []],
                    reward=float(out.get("reward") or 0.0), done=done, info=info)

    def close(self) -> None:
        """Close the current SkyRL env (its databases, HTTP sessions); safe to call twice."""
        env, self.env = self.env, None
        if env is not None:
            env.close()


@functools.lru_cache(maxsize=8)
def _read_rows(path: str, mtime_ns: int) -> tuple[dict[str, Any], ...]:
    """The rows of a task file, read once per process (every episode builds its own SkyRLEnv)."""
    if path.endswith(".jsonl"):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    elif path.endswith(".json"):
        with open(path) as f:
            rows = json.load(f)
    elif path.endswith(".parquet"):
        pandas = import_library("pandas", "pandas", "SkyRLEnv")
        rows = [_plain(r) for r in pandas.read_parquet(path).to_dict("records")]
    else:
        raise ValueError(f"SkyRLEnv: tasks file {path} is not .jsonl, .json or .parquet")
    return tuple(rows)


def _load_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ValueError(f"SkyRLEnv: tasks file {path} does not exist (relative paths start at {os.getcwd()})")
    return [dict(r) for r in _read_rows(path, os.stat(path).st_mtime_ns)]


def _plain(value: Any) -> Any:
    """A parquet row as plain Python: list columns come back as numpy arrays of dicts."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
