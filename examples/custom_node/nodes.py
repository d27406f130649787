"""A user's own nodes, outside the flowrl package, written against the public API only.

    flowrl run examples/custom_node/graph.yaml      (from the repository root)

`Squares` is a source: ticket i becomes the numbers i*n .. i*n+n-1 and their squares.
`Threshold` is a transform with its own typed config. `Tally` is a stateful sink that counts what
passed; its state is checkpointed, so `flowrl run --resume` continues the tally.
"""

import numpy as np

import flowrl


class Squares(flowrl.Source):
    outputs = ("out",)

    async def generate(self, ticket):
        x = np.arange(ticket.index * ticket.size, (ticket.index + 1) * ticket.size, dtype=np.int64)
        return flowrl.Batch(tensors={"x": x, "x2": x * x})


class Threshold(flowrl.Node):
    """Marks which squares exceed `limit`."""

    class Config(flowrl.NodeConfig):
        limit: int = 100
        """Squares above this pass."""

    async def process(self, batch, port):
        passed = batch.tensors["x2"] > self.config.limit
        return batch.replace(tensors={**batch.tensors, "passed": passed})


class Tally(flowrl.Sink):
    stateful = True

    async def setup(self):
        self.passed = 0
        self.total = 0

    async def process(self, batch, port):
        self.passed += int(np.asarray(batch.tensors["passed"]).sum())
        self.total += batch.num_samples
        self.ctx.recorder.mean("pass_rate", self.passed / max(1, self.total))

    def state_dict(self):
        return {"passed": self.passed, "total": self.total}

    def load_state_dict(self, state):
        self.passed, self.total = state["passed"], state["total"]
