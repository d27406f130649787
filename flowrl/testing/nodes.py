"""Small synthetic nodes for runtime tests and benchmarks: no model, known costs, checkable output.

    numbers (Source) -> scale -> collect (Sink)

`Numbers` turns ticket i into x = [i*n, ..., i*n + n - 1]; `Scale` multiplies by a factor;
`Collect` records every batch id it consumed in its state. Costs are `delay_s` sleeps, so a
benchmark can build a pipeline whose bottleneck is known without the 2 cores being the limit.
`Trainer` publishes a weight tensor whose every entry equals its version; `Follower` subscribes
and stamps the version it held on each batch, so tests can check the staleness bound.
None takes an optimizer step, so none preloads torch._dynamo (`flowrl.Node.preload`): the numpy
ones preload nothing, those that hold torch tensors or run collectives torch.
"""

from __future__ import annotations

import time

import anyio
import numpy as np

import flowrl

EXACT_S = 0.003
"""The tail of a cost that `spend` takes off the loop (longer than asyncio's overrun)."""
SPIN_S = 0.0004
"""...and the last of that tail, waited for by reading the clock."""
EXACT_FROM_S = 0.01
"""Costs from this many seconds on (a benchmark's stages) get an exact tail; a shorter one (a test's)
sleeps on the loop alone, so calls running side by side (`concurrency`) are never held up by it."""


async def spend(seconds: float) -> None:
    """Take `seconds`: a stage's known cost. `anyio.sleep` alone runs over by one to two
    milliseconds (asyncio rounds epoll's timeout up to a whole millisecond, and for some lengths
    CPython rounds it up once more: `asyncio.sleep(0.0585)` took 60.4 ms here, `0.0785` 79.4), which a
    benchmark against a bound made of these costs (benchmarks/pipeline.py) counted as the runtime's.
    So a cost of EXACT_FROM_S or more sleeps on the loop (cancellable) but for its last EXACT_S,
    which `time.sleep` takes but for the last SPIN_S: a thread woken from a sleep runs ~0.2 ms late
    on a VM, so that part is waited for by reading the clock (a cancel waits for the tail)."""
    if seconds < EXACT_FROM_S:
        await anyio.sleep(seconds)
        return
    end = time.monotonic() + seconds
    await anyio.sleep(seconds - EXACT_S)
    left = end - time.monotonic() - SPIN_S
    if left > 0:
        time.sleep(left)
    while time.monotonic() < end:
        time.sleep(0)  # lets the process's other threads take the GIL meanwhile


class Numbers(flowrl.Source):
    """Ticket -> batch of `size` consecutive numbers starting at index * size."""

    preload = ()

    class Config(flowrl.NodeConfig):
        delay_s: float = 0.0

    async def generate(self, ticket):
        if self.config.delay_s:
            await spend(self.config.delay_s)
        x = np.arange(ticket.index * ticket.size, (ticket.index + 1) * ticket.size, dtype=np.int64)
        return flowrl.Batch(tensors={"x": x}, meta={"index": ticket.index})


class Scale(flowrl.Node):
    """Multiplies `x` by `factor` after sleeping `delay_s`."""

    preload = ()

    class Config(flowrl.NodeConfig):
        factor: int = 2
        delay_s: float = 0.0

    async def process(self, batch, port):
        if self.config.delay_s:
            await spend(self.config.delay_s)
        return batch.replace(tensors={**batch.tensors, "x": batch.tensors["x"] * self.config.factor})


class Pair(flowrl.Join):
    """Joins two branches: y = a.x + b.x."""

    preload = ()
    inputs = ("a", "b")

    async def join(self, batches):
        a, b = batches["a"], batches["b"]
        return a.replace(tensors={"x": a.tensors["x"] + b.tensors["x"]})


class Collect(flowrl.Sink):
    """Consumes batches; its state is every batch id and sum it saw (checkpointed)."""

    preload = ()
    stateful = True

    class Config(flowrl.NodeConfig):
        delay_s: float = 0.0
        setup_delay_s: float = 0.0
        """Seconds `setup` takes (a slow model load), for start-up ordering tests."""

    async def setup(self):
        self.seen: list[list] = []
        if self.config.setup_delay_s:
            await spend(self.config.setup_delay_s)

    async def process(self, batch, port):
        if self.config.delay_s:
            await spend(self.config.delay_s)
        self.seen.append([batch.batch_id, int(np.asarray(batch.tensors["x"]).sum())])
        self.ctx.recorder.count("samples", batch.num_samples)

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = list(state["seen"])


class Trainer(Collect):
    """A sink that 'trains': after each batch its weights are all equal to the new version."""

    preload = ("torch",)
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

    preload = ("torch",)
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
            await spend(self.config.delay_s)
        held = float(self.w[0]) if self.version else 0.0
        if held != float(self.version):
            raise RuntimeError(f"weights say version {held} but the node holds version {self.version}")
        return batch.replace(policy_version=self.version)


class HeldVersion(Follower):
    """A `Follower` that writes the version it holds to `held_file` whenever one lands."""

    class Config(Follower.Config):
        held_file: str

    def load_weights(self, tensors, version):
        super().load_weights(tensors, version)
        from pathlib import Path

        tmp = Path(self.config.held_file + ".tmp")
        tmp.write_text(str(version))
        tmp.replace(self.config.held_file)


class TrainsWhileServing(Trainer):
    """A `Trainer` whose call for a batch returns only once the subscriber (`HeldVersion`) holds the
    trainer's current version: it finishes only if the publisher serves a sync while a call of its
    own is running (with `max_staleness >= 1`, the subscriber takes that version between two of its
    batches, which need nothing newer). Fails after `wait_s` naming what it waited for."""

    class Config(Trainer.Config):
        held_file: str
        wait_s: float = 60.0

    async def process(self, batch, port):
        import time
        from pathlib import Path

        wanted, held = self.ctx.policy_version, Path(self.config.held_file)
        deadline = time.monotonic() + self.config.wait_s
        while not (held.exists() and int(held.read_text() or 0) >= wanted):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the subscriber never took version {wanted} while {batch.batch_id} was in "
                                   "the trainer: a sync order waits for the call that runs")
            await anyio.sleep(0.005)  # polls a condition; the order of events does not depend on it
        await super().process(batch, port)


def chain_digest(previous: str, batch) -> str:
    """One link of a hash chain over (batch id, content): equal chains = the same tickets, in the same
    order, each once."""
    import hashlib

    x = np.ascontiguousarray(np.asarray(batch.tensors["x"]))
    return hashlib.sha256(previous.encode() + batch.batch_id.encode() + x.tobytes()).hexdigest()[:32]


class Normalizer(flowrl.Node):
    """A stateful transform (a running normaliser): folds every batch into a hash chain and a count,
    and forwards the batch with the count it saw. Its final state proves each ticket was folded in
    once, in order."""

    preload = ()
    stateful = True

    class Config(flowrl.NodeConfig):
        delay_s: float = 0.0

    async def setup(self):
        self.count, self.chain = 0, ""

    async def process(self, batch, port):
        if self.config.delay_s:
            await spend(self.config.delay_s)
        self.count += 1
        self.chain = chain_digest(self.chain, batch)
        return batch.replace(tensors={**batch.tensors, "count": np.full(batch.num_samples, self.count, np.int64)})

    def state_dict(self):
        return {"count": self.count, "chain": self.chain}

    def load_state_dict(self, state):
        self.count, self.chain = int(state["count"]), str(state["chain"])


class Chain(Collect):
    """A stateful sink whose state is a hash chain over what it consumed (see `Normalizer`)."""

    async def setup(self):
        await super().setup()
        self.chain = ""

    async def process(self, batch, port):
        await super().process(batch, port)
        self.chain = chain_digest(self.chain, batch)

    def state_dict(self):
        return {"seen": self.seen, "chain": self.chain}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.chain = str(state["chain"])


class Logger(flowrl.Sink):
    """A sink without state (a logger, an evaluator): it only writes a line per batch."""

    preload = ()

    async def process(self, batch, port):
        self.ctx.log.info("consumed %s", batch.batch_id)


class DropEvery(flowrl.Node):
    """A filter: drops the tickets whose index % every == remainder, and shrinks the others to
    their first `keep` samples (0: keep all). `empty: true` drops by returning an empty batch."""

    preload = ()

    class Config(flowrl.NodeConfig):
        every: int = 3
        remainder: int = 1
        keep: int = 0
        empty: bool = False
        replace: bool = False
        """Drop with replace=True (a misuse: this node is not stateful, so it holds nothing)."""

    async def process(self, batch, port):
        if batch.index % self.config.every == self.config.remainder:
            return batch.select([]) if self.config.empty else \
                flowrl.Drop(f"index {batch.index}", replace=self.config.replace)
        return batch.select(slice(0, self.config.keep)) if self.config.keep else batch


class Faulty(flowrl.Node):
    """Raises `KeyError('scores')` at ticket `fail_at`, every time it sees it (a deterministic bug),
    or returns a `bad_return` value instead of a batch."""

    preload = ()

    class Config(flowrl.NodeConfig):
        fail_at: int = -1
        bad_return: bool = False

    async def process(self, batch, port):
        if batch.index == self.config.fail_at:
            return batch.tensors["scores"]
        if self.config.bad_return:
            return [batch]
        return batch


class StrictNormalizer(Normalizer):
    """A `Normalizer` that declares its input: batches without an int64 `x` are rejected."""

    requires = {"x": "int64"}


class WantsScores(Normalizer):
    """A `Normalizer` that declares a tensor `Numbers` never makes: every batch is refused."""

    requires = {"scores": "float32"}


class Groups(flowrl.Source):
    """Ticket -> `size` prompt groups of `samples` rows each, as a rollout + reward would emit them:
    `rows` is each sample's prompt number (index * size + g), `scores` alternate 0/1 within a group,
    except for prompts whose number % `flat_every` == 0, whose samples all score 1 (nothing to
    learn: a DAPO filter drops them)."""

    preload = ()

    class Config(flowrl.NodeConfig):
        samples: int = 2
        flat_every: int = 3

    async def generate(self, ticket):
        g = self.config.samples
        rows = np.repeat(np.arange(ticket.index * ticket.size, (ticket.index + 1) * ticket.size, dtype=np.int64), g)
        scores = np.tile(np.arange(g, dtype=np.float32) % 2, ticket.size)
        scores[rows % self.config.flat_every == 0] = 1.0
        return flowrl.Batch(tensors={"rows": rows, "scores": scores}, meta={"samples_per_prompt": g})


class Rows(Collect):
    """A stateful sink that records the prompt numbers (`rows`) of every batch it trains on."""

    async def process(self, batch, port):
        if self.config.delay_s:
            await spend(self.config.delay_s)
        rows = np.asarray(batch.tensors["rows"])
        self.seen.append([batch.batch_id, rows.tolist()])
        self.ctx.recorder.count("samples", batch.num_samples)


def _group_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class GroupSum(flowrl.Node):
    """A data-parallel transform whose `process` runs a collective, as a DDP backward does: each rank
    all-reduces the sum of its shard's `x`, and every row gets the group's total (`total`), so the
    output depends on every rank having taken part. On one rank the total is the batch's own sum."""

    preload = ("torch",)

    class Config(flowrl.NodeConfig):
        delay_s: float = 0.0

    async def process(self, batch, port):
        import torch
        import torch.distributed as dist

        if self.config.delay_s:
            await spend(self.config.delay_s)
        total = torch.tensor([int(np.asarray(batch.tensors["x"]).sum())], dtype=torch.int64)
        if _group_size() > 1:
            dist.all_reduce(total)
        return batch.replace(tensors={**batch.tensors, "total": np.full(batch.num_samples, int(total), np.int64)})


class GroupTrainer(Collect):
    """A data-parallel trainer like an FSDP2 one: its weight `w` is sharded over the ranks (a DTensor),
    `process` all-reduces a loss count, and a weight snapshot gathers the full `w` from every rank
    (`flowrl.rl.publish.FullState`: the publisher on rank 0, `drain` on the others), so publishing is
    a collective too. After each batch every entry of `w` equals the new version (as `Trainer`)."""

    preload = ("torch",)
    publishes_weights = True

    class Config(Collect.Config):
        size: int = 1024

    async def setup(self):
        await super().setup()
        import torch
        from torch import nn

        from flowrl.rl.publish import FullState

        w = torch.zeros(self.config.size)
        if _group_size() > 1:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Shard, distribute_tensor

            w = distribute_tensor(w, init_device_mesh("cpu", (_group_size(),)), [Shard(0)])
        self.model = nn.Module()
        self.model.w = nn.Parameter(w, requires_grad=False)
        self.view = FullState(self.model)
        self.samples = 0

    async def process(self, batch, port):
        import torch
        import torch.distributed as dist

        if self.config.delay_s:
            await spend(self.config.delay_s)
        x = np.asarray(batch.tensors["x"])
        total = batch.tensors.get("total")  # GroupSum's group total, when it is upstream
        self.seen.append([batch.batch_id, int(x.sum()), None if total is None else int(np.asarray(total)[0])])
        self.ctx.recorder.count("samples", batch.num_samples)
        count = torch.tensor([batch.num_samples], dtype=torch.int64)
        if _group_size() > 1:
            dist.all_reduce(count)
        self.samples += int(count)
        with torch.no_grad():
            self.model.w.fill_(self.ctx.policy_version + 1)

    def weights(self):
        return self.view

    def state_dict(self):
        from flowrl.rl.parallel import is_dtensor

        w = self.model.w.to_local() if is_dtensor(self.model.w) else self.model.w
        return {"seen": self.seen, "samples": self.samples, "w": w.detach().clone()}

    def load_state_dict(self, state):
        import torch

        from flowrl.rl.parallel import is_dtensor

        self.seen, self.samples = list(state["seen"]), int(state["samples"])
        local = self.model.w.to_local() if is_dtensor(self.model.w) else self.model.w
        with torch.no_grad():
            local.copy_(state["w"])


class Overlap(flowrl.Node):
    """A stateless weight subscriber for `concurrency` tests, shaped like a continuous rollout: each
    call counts the calls in flight with it, then waits (at most `wait_s`) until it holds the version
    its update trains at (`index // per_update`: with `max_staleness: 1` a ticket may start one
    version early, and that version then lands while the call is in flight, as in a partial
    rollout). Every sample gets `seen = [version at start, version at end, most calls in flight]`;
    the batch's `policy_version` is the version it started with (its oldest token's)."""

    preload = ("torch",)
    subscribes_weights = True

    class Config(flowrl.NodeConfig):
        size: int = 1024
        per_update: int = 1
        wait_s: float = 10.0

    async def setup(self):
        import asyncio

        import torch

        self.w = torch.zeros(self.config.size)
        self.version = 0
        self.in_flight = self.most = 0
        self.landed = asyncio.Event()  # set (and replaced) by every version that lands

    def weights(self):
        return {"w": self.w}

    async def before_weights(self, version):
        self.ctx.recorder.count("before_weights", 1)

    def load_weights(self, tensors, version):
        import asyncio

        self.version = version
        self.landed.set()
        self.landed = asyncio.Event()

    async def process(self, batch, port):
        import asyncio

        start, need = self.version, batch.index // self.config.per_update
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            deadline = asyncio.get_running_loop().time() + self.config.wait_s
            while self.version < need and (left := deadline - asyncio.get_running_loop().time()) > 0:
                try:
                    await asyncio.wait_for(self.landed.wait(), left)
                except asyncio.TimeoutError:
                    break
        finally:
            self.in_flight -= 1
        seen = np.tile(np.array([[start, self.version, self.most]], dtype=np.int64), (batch.num_samples, 1))
        return batch.replace(tensors={**batch.tensors, "seen": seen}, policy_version=start)


class UpdateLog(Trainer):
    """A `Trainer` that records, per update, the `x` it trained on, each sample's `seen` (from
    `Overlap`), the batch's oldest version and the version it trained at."""

    async def process(self, batch, port):
        await super().process(batch, port)
        self.seen[-1] += [np.asarray(batch.tensors["x"]).tolist(), np.asarray(batch.tensors["seen"]).tolist(),
                          batch.policy_version, self.ctx.policy_version]


class Asker(flowrl.Source):
    """A client of a service (`services: [asker -> rollout]`): per ticket, `turns` rounds of
    `size` concurrent requests, each continuing its own session's tokens so far. Emits `x`: the
    tokens each session generated, and `replicas`: which rollout replica served its last turn.
    Checks on the way that every answer is whole (tokens, log-probs, versions aligned)."""

    preload = ()

    class Config(flowrl.NodeConfig):
        turns: int = 2
        max_new_tokens: int = 6
        service: str = "rollout"
        timeout_s: float = 120.0

    async def generate(self, ticket):
        import asyncio

        gen = self.ctx.services[self.config.service]

        async def episode(i):
            tokens, made, replica = [12, 1 + i % 9, 2, 3], 0, -1
            for turn in range(self.config.turns):
                out = await gen.complete(tokens, session=f"{ticket.batch_id}:{ticket.attempt}:{i}",
                                         max_new_tokens=self.config.max_new_tokens, stop=(13,),
                                         min_version=ticket.min_policy_version,
                                         seed=ticket.index * 1000 + i * 10 + turn, timeout_s=self.config.timeout_s)
                if not (len(out.tokens) == len(out.logprobs) == len(out.versions) and out.tokens):
                    raise AssertionError(f"a torn completion: {out}")
                tokens += out.tokens + [11]
                made += len(out.tokens)
                replica = out.replica
            return made, replica

        done = await asyncio.gather(*(episode(i) for i in range(ticket.size)))
        return flowrl.Batch(tensors={"x": np.array([d[0] for d in done], dtype=np.int64),
                                     "replicas": np.array([d[1] for d in done], dtype=np.int64)},
                            meta={"index": ticket.index})


class ServedBy(Collect):
    """`Collect` that also keeps which replica served each of `Asker`'s sessions (`replicas`)."""

    async def process(self, batch, port):
        await super().process(batch, port)
        self.seen[-1].append(np.asarray(batch.tensors["replicas"]).tolist())
