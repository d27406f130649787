"""Tiny node classes for graph-structure tests."""

import flowrl
from flowrl.testing.nodes import GroupTrainer


class Pass(flowrl.Node):
    async def process(self, batch, port):
        return batch


class TwoIn(flowrl.Join):
    inputs = ("x", "y")


class HangsInSetup(flowrl.Node):
    """A setup that never returns, blocked in C (a collective or a driver call, say); with `rank`,
    only that data-parallel rank's."""

    class Config(flowrl.NodeConfig):
        rank: int | None = None

    async def setup(self):
        import threading

        if self.config.rank is None or self.config.rank == self.ctx.rank:
            threading.Event().wait()  # blocks its thread, no timeout: the supervisor's startup timeout ends it

    async def process(self, batch, port):
        return batch


class TrainerHangsInSetup(GroupTrainer):
    """A data-parallel trainer whose rank `hang_rank` never finishes setup: the others then wait
    in the first weight snapshot's gather (before READY) for it."""

    class Config(GroupTrainer.Config):
        hang_rank: int = 1

    async def setup(self):
        import threading

        if self.ctx.rank == self.config.hang_rank:
            threading.Event().wait()  # blocks its thread, no timeout
        await super().setup()
