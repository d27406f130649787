"""Tiny node classes for graph-structure tests."""

import flowrl


class Pass(flowrl.Node):
    async def process(self, batch, port):
        return batch


class TwoIn(flowrl.Join):
    inputs = ("x", "y")
