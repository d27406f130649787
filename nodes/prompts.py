"""The data source: turns scheduler tickets into prompt batches from a procedural task.

The prompts of ticket i are a pure function of (seed, i): the data cursor is the ticket index, so
a replayed ticket gets exactly the same prompts and a resumed run continues the same stream.
"""

import flowrl
from flowrl.nodes.common import TaskConfig


class Prompts(flowrl.Source):
    """`schedule.batch_size` prompts per ticket."""

    class Config(TaskConfig):
        pass

    async def setup(self):
        from flowrl.tasks import build_task

        self.task = build_task(self.config.task)

    async def generate(self, ticket):
        prompts, targets = self.task.prompts(self.ctx.seed, ticket.index * ticket.size, ticket.size)
        # the digit tasks' prompts happen to share one length: whole rows
        return flowrl.Batch(tensors={"prompts": flowrl.Ragged.from_padded(prompts), "targets": targets},
                            meta={"max_new_tokens": self.task.max_new_tokens})
