"""A host node with nodes fused into it (`fuse_into`, flowrl.graph.fusion): one class, one call.

    cls = node_class(graph.nodes["rollout"])     # Rollout, or a subclass that runs its fused nodes
    node = cls(config, ctx)                      # builds the fused nodes too, each with its own context

The subclass's `process` (or `generate`, `join`: whichever its host's shape calls) awaits the
host's own, then hands the host's output on each fused port through the fused nodes in order, on
the same compute thread, inside the same call: one ticket, one call, one record of its outputs. A
fused node sees the batch as its own input would have carried it; what it returns replaces it
(None, a Drop or an empty batch drops the ticket on that port, as from any node). A batch that
lacks what the fused node `requires` is a contract error of the host's output, named as such.
`setup` and `wake` run the host first, then the fused nodes; `teardown` and `sleep` the other way.
Each fused node gets the host's context with its own name, kind, dtype and logger, and shares the
host's recorder (its metrics are its host process's).
"""

from __future__ import annotations

import dataclasses
import logging

from flowrl.graph.fusion import fused_port
from flowrl.graph.kinds import resolve_kind
from flowrl.graph.shapes import is_source
from flowrl.node import Drop, Join
from flowrl.runtime.worker.contract import NodeContractError, outputs_of


def node_class(node_spec) -> type:
    """The class a node process builds for `node_spec`: its kind's, with its fused nodes if any."""
    cls = resolve_kind(node_spec.kind)
    if not node_spec.fused:
        return cls
    chain = tuple((name, resolve_kind(f.kind), f) for name, f in node_spec.fused.items())
    method = "generate" if is_source(cls) else "join" if issubclass(cls, Join) else "process"
    preload = tuple(dict.fromkeys(cls.preload + tuple(m for _, c, _ in chain for m in c.preload)))
    return type(f"{cls.__name__}+{'+'.join(n for n, _, _ in chain)}", (_Fused, cls),
                {"fused_chain": chain, "preload": preload, method: _wrapped(cls, method), "__module__": cls.__module__})


def _wrapped(cls: type, method: str):
    own = getattr(cls, method)

    async def call(self, *args):
        return await self.run_fused(await own(self, *args), method)

    call.__name__ = call.__qualname__ = method
    return call


class _Fused:
    """What a host class gains (mixed in before it): its fused nodes, built and run."""

    fused_chain: tuple = ()

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        self.fused_nodes = []
        for name, cls, spec in self.fused_chain:
            fctx = dataclasses.replace(ctx, name=name, kind=spec.kind, dtype=spec.dtype,
                                       log=logging.getLogger(f"flowrl.node.{name}"))
            self.fused_nodes.append((name, fused_port(spec), cls(cls.Config.model_validate(spec.config), fctx)))

    async def run_fused(self, result, method: str):
        from flowrl.runtime.worker.datapath import missing_tensors

        outs = outputs_of(result, node=self.ctx.name, method=method, ports=self.outputs)
        for name, port, node in self.fused_nodes:
            batch = outs[port]
            if isinstance(batch, Drop):
                continue
            lacks = missing_tensors(batch, node.requires) if node.requires else None
            if lacks is not None:
                raise NodeContractError(f"node {name!r}, fused into {self.ctx.name!r}, takes {self.ctx.name}.{port}: "
                                        f"{lacks}; fuse it after a node that makes what it requires")
            try:
                got = await node.process(batch, node.inputs[0])
            except Exception as e:  # the host's failure (its restart, its budget): say which node raised
                e.add_note(f"raised by node {name!r}, fused into {self.ctx.name!r}")
                raise
            outs[port] = outputs_of(got, node=name, method="process", ports=node.outputs)[node.outputs[0]]
        return outs

    async def setup(self):
        await super().setup()
        for _, _, node in self.fused_nodes:
            await node.setup()

    async def wake(self):
        await super().wake()
        for _, _, node in self.fused_nodes:
            await node.wake()

    async def sleep(self):
        for _, _, node in reversed(self.fused_nodes):
            await node.sleep()
        await super().sleep()

    async def teardown(self):
        for _, _, node in reversed(self.fused_nodes):
            await node.teardown()
        await super().teardown()
