"""A host node with nodes fused into it (`fuse_into`, flowrl.graph.fusion): one class, one call.

    cls = node_class(graph.nodes["rollout"])     # Rollout, or a subclass that runs its fused nodes
    node = cls(config, ctx)                      # builds the fused nodes too, each with its own context

The subclass's `process` (or `generate`, `join`: whichever its host's shape calls) awaits the
host's own, then hands the host's output on each fused port through the fused nodes in order, on
the same compute thread, inside the same call: one ticket, one call, one record of its outputs. A
fused node sees the batch as its own input would have carried it; what it returns replaces it
(None, a Drop or an empty batch drops the ticket on that port, as from any node). A batch that
lacks what the node taking it `requires` is a contract error, named as such.
With a source fused before it (the host is then a source), `generate(ticket)` asks the source for
the ticket's batch and makes the host's own call on it (a Drop from the source drops the ticket),
then runs the chain after it.
`setup` and `wake` run the host first, then the fused nodes; `teardown` and `sleep` the other way.
Each fused node gets the host's context with its own name, kind, dtype and logger, and shares the
host's recorder (its metrics are its host process's).
"""

from __future__ import annotations

import dataclasses
import logging

from flowrl.graph.fusion import fused_port, host_class
from flowrl.graph.kinds import resolve_kind
from flowrl.graph.shapes import is_source
from flowrl.node import Drop, Join, Ticket
from flowrl.runtime.worker.contract import NodeContractError, outputs_of
from flowrl.runtime.worker.datapath import missing_tensors


def node_class(node_spec) -> type:
    """The class a node process builds for `node_spec`: its kind's, with its fused nodes if any."""
    cls = resolve_kind(node_spec.kind)
    if not node_spec.fused:
        return cls
    chain = tuple((name, resolve_kind(f.kind), f) for name, f in node_spec.fused.items())
    base = host_class(cls, {name: c for name, c, _ in chain})
    if is_source(base) and not is_source(cls):  # a source fused before it: tickets in, the host's call after
        attrs = {"generate": _fed(cls)}
    else:
        method = "generate" if is_source(cls) else "join" if issubclass(cls, Join) else "process"
        attrs = {method: _wrapped(cls, method)}
    return type(base.__name__, (_Fused, base), {"fused_chain": chain, "__module__": cls.__module__, **attrs})


def _wrapped(cls: type, method: str):
    own = getattr(cls, method)

    async def call(self, *args):
        return await self.run_fused(await own(self, *args), method, _route(args[0]))

    call.__name__ = call.__qualname__ = method
    return call


def _fed(cls: type):
    """`generate` of a host whose input a fused source makes: the source's batch, the host's call."""
    own = cls.process

    async def generate(self, ticket):
        name, port, source = self.fused_source
        route = _route(ticket)
        try:
            made = await source.generate(ticket)
        except Exception as e:  # as in run_fused: the host's failure, naming the node that raised
            e.add_note(f"raised by node {name!r}, fused into {self.ctx.name!r}")
            raise
        batch = outputs_of(made, node=name, method="generate", ports=source.outputs)[source.outputs[0]]
        if isinstance(batch, Drop):  # nothing to work on: the ticket is dropped on every output
            return batch
        self.check_input(batch, name, cls.requires, f"{name}.{source.outputs[0]}", self.ctx.name)
        return await self.run_fused(await own(self, _stamped(batch, route), port), "process", route)

    return generate


def _route(work) -> tuple:
    """The routing facts a call's input gives its outputs (what outputs.py stamps on what a node
    sends): from a ticket (a source's call; no policy version yet), a batch, or a join's parts."""
    if isinstance(work, dict):
        work = next(iter(work.values()))
    if isinstance(work, Ticket):
        return work.batch_id, work.attempt, work.index, work.min_policy_version, work.epoch, -1
    return work.batch_id, work.attempt, work.index, work.min_version, work.epoch, work.policy_version


def _stamped(batch, route: tuple):
    """`batch` as a channel would have delivered it: the routing facts of the ticket it is for."""
    bid, attempt, index, min_version, epoch, pv = route
    if (batch.batch_id, batch.attempt, batch.index, batch.min_version, batch.epoch) == route[:5] \
            and (batch.policy_version >= 0 or pv < 0):
        return batch  # it carries them already (a batch the host derived from its input)
    return batch.replace(batch_id=bid, attempt=attempt, index=index, min_version=min_version, epoch=epoch,
                         policy_version=batch.policy_version if batch.policy_version >= 0 else pv)


class _Fused:
    """What a host class gains (mixed in before it): its fused nodes, built and run."""

    fused_chain: tuple = ()

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        self.fused_nodes, self.fused_source = [], None
        for name, cls, spec in self.fused_chain:
            fctx = dataclasses.replace(ctx, name=name, kind=spec.kind, dtype=spec.dtype,
                                       log=logging.getLogger(f"flowrl.node.{name}"))
            entry = (name, fused_port(spec), cls(cls.Config.model_validate(spec.config), fctx))
            if is_source(cls):
                self.fused_source = entry
            else:
                self.fused_nodes.append(entry)

    @staticmethod
    def check_input(batch, name: str, requires: dict, came_from: str, taker: str) -> None:
        lacks = missing_tensors(batch, requires) if requires else None
        if lacks is not None:
            raise NodeContractError(f"node {taker!r} takes {came_from} in one process (fused): {lacks}; fuse "
                                    f"{name if taker != name else 'it'} next to a node that makes what it requires")

    async def run_fused(self, result, method: str, route: tuple):
        outs = outputs_of(result, node=self.ctx.name, method=method, ports=self.outputs)
        for name, port, node in self.fused_nodes:
            batch = outs[port]
            if isinstance(batch, Drop):
                continue
            self.check_input(batch, name, node.requires, f"{self.ctx.name}.{port}", name)
            try:
                got = await node.process(_stamped(batch, route), node.inputs[0])
            except Exception as e:  # the host's failure (its restart, its budget): say which node raised
                e.add_note(f"raised by node {name!r}, fused into {self.ctx.name!r}")
                raise
            outs[port] = outputs_of(got, node=name, method="process", ports=node.outputs)[node.outputs[0]]
        return outs

    def _all(self) -> list:
        return ([self.fused_source] if self.fused_source else []) + self.fused_nodes

    async def setup(self):
        await super().setup()
        for _, _, node in self._all():
            await node.setup()

    async def wake(self):
        await super().wake()
        for _, _, node in self._all():
            await node.wake()

    async def sleep(self):
        for _, _, node in reversed(self._all()):
            await node.sleep()
        await super().sleep()

    async def teardown(self):
        for _, _, node in reversed(self._all()):
            await node.teardown()
        await super().teardown()
