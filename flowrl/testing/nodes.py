"""Small synthetic nodes for runtime tests and benchmarks: no model, known costs, checkable output.

    numbers (Source) -> scale -> collect (Sink)

`Numbers` turns ticket i into x = [i*n, ..., i*n + n - 1]; `Scale` multiplies by a factor;
`Collect` records every batch id it consumed in its state. Costs are `delay_s` sleeps, so a
benchmark can build a pipeline whose bottleneck is known without the 2 cores being the limit.
`Trainer` publishes a weight tensor whose every entry equals its version; `Follower` subscribes
and stamps the version it held on each batch, so tests can check the staleness bound.
"""

from __future__ import annotations

import anyio
import numpy as np

import flowrl


class Numbers(flowrl.Source):
    """Ticket -> batch of `size` consecutive numbers starting at index * size."""

    class Config(flowrl.NodeConfig):
        delay_s: float = 0.0

    async def generate(self, ticket):
        if self.config.delay_s:
            await anyio.sleep(self.config.delay_s)
        x = np.arange(ticket.index * ticket.size, (ticket.index + 1) * ticket.size, dtype=np.int64)
        return flowrl.Batch(tensors={"x": x}, meta={"index": ticket.index})


class Scale(flowrl.Node):
    """Multiplies `x` by `factor` after sleeping `delay_s`."""

    class Config(flowrl.NodeConfig):
        factor: int = 2
        delay_s: float = 0.0

    async def process(self, batch, port):
        if self.config.delay_s:
            await anyio.sleep(self.config.delay_s)
        return batch.replace(tensors={**batch.tensors, "x": batch.tensors["x"] * self.config.factor})


class Pair(flowrl.Join):
    """Joins two branches: y = a.x + b.x."""

    inputs = ("a", "b")

    async def join(self, batches):
        a, b = batches["a"], batches["b"]
        return a.replace(tensors={"x": a.tensors["x"] + b.tensors["x"]})


class Collect(flowrl.Sink):
    """Consumes batches; its state is every batch id and sum it saw (checkpointed)."""

    stateful = True

    class Config(flowrl.NodeConfig):
        delay_s: float = 0.0
        setup_delay_s: float = 0.0
        """Seconds `setup` takes (a slow model load), for start-up ordering tests."""

    async def setup(self):
        self.seen: list[list] = []
        if self.config.setup_delay_s:
            await anyio.sleep(self.config.setup_delay_s)

    async def process(self, batch, port):
        if self.config.delay_s:
            await anyio.sleep(self.config.delay_s)
        self.seen.append([batch.batch_id, int(np.asarray(batch.tensors["x"]).sum())])
        self.ctx.recorder.count("samples", batch.num_samples)

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = list(state["seen"])


class Trainer(Collect):
    """A sink that 'trains': after each batch its weights are all equal to the new version."""

    publishes_weights = True

    class Config(Collect.Config):
        size: int = 1024

    async def setup(self):
        await super().setup()
        import torch

        self.w = torch.zeros(self.config.size)

    async def process(self, batch, port):
        await super().process(batch, port)
        self.w.fill_(self.ctx.policy_version + 1)
        self.ctx.recorder.max("staleness_seen", self.ctx.policy_version - batch.policy_version)

    def weights(self):
        return {"w": self.w}

    def state_dict(self):
        return {"seen": self.seen, "w": self.w.clone()}

    def load_state_dict(self, state):
        self.seen = list(state["seen"])
        self.w = state["w"]


class Follower(flowrl.Node):
    """Subscribes to `Trainer`'s weights; stamps each batch with the version it holds and checks
    that the weights it holds are exactly that version's."""

    subscribes_weights = True

    class Config(flowrl.NodeConfig):
        delay_s: float = 0.0
        size: int = 1024

    async def setup(self):
        import torch

        self.w = torch.zeros(self.config.size)
        self.version = 0

    def weights(self):
        return {"w": self.w}

    def load_weights(self, tensors, version):
        self.version = version

    async def process(self, batch, port):
        if self.config.delay_s:
            await anyio.sleep(self.config.delay_s)
        held = float(self.w[0]) if self.version else 0.0
        if held != float(self.version):
            raise RuntimeError(f"weights say version {held} but the node holds version {self.version}")
        return batch.replace(policy_version=self.version)
