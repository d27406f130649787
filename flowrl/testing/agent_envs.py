"""Environments that misbehave on purpose, for fault tests of agent graphs (tests/integration/test_agents.py).

`Flaky` is the `guess` game, except that on every task whose index is 1 mod `every` the
environment raises in `step`, and on every task whose index is 2 mod `every` it hangs in `reset`
for `hang_s` seconds (longer than the agent's `episode_timeout_s`): the episodes end `env_error`
and `deadline`, the others play on, and the run goes on without a restart.
"""

from __future__ import annotations

import time

from flowrl.agents.envs import GuessEnv


class Flaky(GuessEnv):
    def __init__(self, every: int = 4, hang_s: float = 3.0, **kw):
        super().__init__(**kw)
        self.every, self.hang_s = every, hang_s

    def reset(self, task):
        self.index = int(task["index"])
        if self.index % self.every == 2:
            time.sleep(self.hang_s)  # in a worker thread: the episode's deadline ends the episode first
        return super().reset(task)

    def step(self, text):
        if self.index % self.every == 1:
            raise RuntimeError(f"the environment of task {self.index} broke")
        return super().step(text)
