"""Nodes that say what their fork server preloaded (tests/runtime/test_preload.py)."""

import json
import os
import sys
from pathlib import Path

import flowrl
from flowrl.testing.nodes import Collect

WATCH = ("torch", "torch._dynamo", "tabnanny")


def write_held(out: str) -> None:
    """Which of `WATCH` this process held before its node's code ran (what the fork server imported
    before the fork); then torch imported, and how many threads it got."""
    held = [m for m in WATCH if m in sys.modules]
    import torch

    if out:
        Path(out).write_text(json.dumps({"held": held, "threads": torch.get_num_threads(),
                                         "omp": os.environ.get("OMP_NUM_THREADS")}))


class Modules(flowrl.Sink):
    """A sink that writes `write_held` into `out` at setup."""

    preload = ("tabnanny",)

    class Config(flowrl.NodeConfig):
        out: str = ""

    async def setup(self):
        write_held(self.config.out)

    async def process(self, batch, port):
        return None


class StatefulModules(Collect):
    """`Modules` with a state to checkpoint: the runtime's `torch.save` needs torch."""

    preload = ("tabnanny",)

    class Config(Collect.Config):
        out: str = ""

    async def setup(self):
        write_held(self.config.out)
        await super().setup()


class DefaultModules(Modules):
    """`Modules` with `flowrl.Node`'s preload."""

    preload = flowrl.Node.preload


class Subscriber(Modules):
    """`Modules` that subscribes to weights (a torch.distributed group)."""

    preload = ()
    subscribes_weights = True


class Light(flowrl.Source):
    """A source whose preload names a module that does not exist: the fork server says so and goes on."""

    preload = ("flowrl_no_such_module",)

    async def generate(self, ticket):
        import numpy as np

        return flowrl.Batch(tensors={"x": np.arange(ticket.size, dtype=np.int64)})
