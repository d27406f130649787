"""A multi-turn environment in a few lines: the model is shown a number and must say it back,
then say it back reversed. Plain methods run in a thread of their own; `async def` works too."""

import random

from flowrl.agents import Step


class EchoBack:
    def __init__(self, digits: int = 3):
        self.digits = digits

    def reset(self, task):  # task: {"index", "sample", "seed", "ticket"}: the same task, the same episode
        rng = random.Random(task["seed"] * 1_000_003 + task["index"])
        self.number = "".join(rng.choice("0123456789") for _ in range(self.digits))
        self.turn = 0
        return self.number + "\n"  # the first message (a str: one user message)

    def step(self, text):  # the model's turn, as text
        want = self.number if self.turn == 0 else self.number[::-1]
        reward = sum(a == b for a, b in zip(text, want)) / (2 * len(want))
        self.turn += 1
        if self.turn == 2:
            return Step(reward=reward, done=True)
        return Step(messages=[{"role": "user", "content": "R\n"}], reward=reward)  # now reversed
