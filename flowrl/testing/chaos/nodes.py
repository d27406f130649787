"""Synthetic nodes for shape x fault tests: deterministic, cheap, no model, no sleeps.

    TicketSource -> Mix -> Fold (stateful) -> Drop -> Merge.a ... -> FoldSink (stateful), LogSink

`Hold` (stateful, like a DAPO filter) holds some tickets' batches and drops them with
`replace=True`; the runtime then issues one more ticket, and the held values go out in front of
the next batch the node passes on.

Every batch is `x`: int64[size] plus `meta["ix"]`, the ticket index. Every output is a pure function
of the input, so what each node should see is known from the graph alone (`flowrl.testing.chaos.model`
computes it). A stateful node's state is a hash chain over (batch id, digest of the batch's content)
in the order it folded them, plus the indices it folded: after any crash, equal to a fault-free run's
state bitwise only if it saw each ticket exactly once, in index order.

Module import is light (numpy and hashlib only), as node modules must be.
"""

from __future__ import annotations

import hashlib

import numpy as np

import flowrl

MOD = (1 << 31) - 1  # values stay in [0, MOD): int64 products never overflow


def source_values(seed: int, index: int, size: int) -> np.ndarray:
    """The content of ticket `index`: `size` pseudo-random int64 in [0, MOD)."""
    return np.random.default_rng([seed, index]).integers(0, MOD, size=size, dtype=np.int64)


def mix_values(x: np.ndarray, mul: int, add: int) -> np.ndarray:
    return (x * mul + add) % MOD


def drops(seed: int, batch_id: str, rate: float) -> bool:
    """Whether a `Drop` filter with this seed drops this batch (a hash, so it never changes)."""
    h = int.from_bytes(hashlib.blake2b(f"{seed}:{batch_id}".encode(), digest_size=8).digest(), "little")
    return (h % 10_000) < rate * 10_000


def holds(seed: int, batch_id: str, rate: float) -> bool:
    """Whether a `Hold` node with this seed holds this batch (a hash, other than `drops`')."""
    return drops(seed + 7_919, batch_id, rate)


def shrink_mask(x: np.ndarray, seed: int) -> np.ndarray:
    """Samples a `Shrink` filter keeps: about half, never none (the first is always kept)."""
    keep = ((x ^ seed) * 2654435761 % MOD) % 2 == 0
    keep[:1] = True
    return keep


def content_digest(batch_id: str, x: np.ndarray) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(batch_id.encode())
    h.update(np.ascontiguousarray(x, dtype=np.int64).tobytes())
    return h.digest()


def fold_state(chain: str, batch_id: str, x: np.ndarray) -> str:
    """One step of a stateful node's hash chain."""
    return hashlib.blake2b(bytes.fromhex(chain) + content_digest(batch_id, x), digest_size=16).hexdigest()


EMPTY_CHAIN = "00" * 16


def index_of(batch) -> int:
    return int(batch.meta["ix"])


class TicketSource(flowrl.Source):
    """Ticket i -> x = source_values(seed, i, ticket.size)."""

    class Config(flowrl.NodeConfig):
        seed: int = 0
        """Seeds the content (a node's seed, not the graph's: it is part of the shape)."""

    async def generate(self, ticket):
        return flowrl.Batch(tensors={"x": source_values(self.config.seed, ticket.index, ticket.size)},
                            meta={"ix": ticket.index})


class Mix(flowrl.Node):
    """Stateless transform: x -> (x * mul + add) mod MOD."""

    class Config(flowrl.NodeConfig):
        mul: int = 3
        add: int = 1

    async def process(self, batch, port):
        return batch.replace(tensors={"x": mix_values(np.asarray(batch.tensors["x"]), self.config.mul, self.config.add)})


class Drop(flowrl.Node):
    """Filter: drops a ticket (returns None) when a hash of its batch id and `seed` says so."""

    class Config(flowrl.NodeConfig):
        seed: int = 0
        rate: float = 0.25
        """Fraction of tickets dropped (by hash, so the same ones in every run)."""

    async def process(self, batch, port):
        if drops(self.config.seed, batch.batch_id, self.config.rate):
            return None
        return batch


class Shrink(flowrl.Node):
    """Filter: keeps about half of a batch's samples (by a hash of their values), never none."""

    class Config(flowrl.NodeConfig):
        seed: int = 0

    async def process(self, batch, port):
        return batch.select(shrink_mask(np.asarray(batch.tensors["x"]), self.config.seed))


class Hold(flowrl.Node):
    """Stateful filter: holds the batch of a ticket that `holds(seed, batch id, rate)` picks (at most
    `max_held` in a row), dropping the ticket with `replace=True`; the next batch it passes on
    carries every held value in front of its own."""

    stateful = True

    class Config(flowrl.NodeConfig):
        seed: int = 0
        rate: float = 0.3
        max_held: int = 2

    async def setup(self):
        self.held: list[list[int]] = []

    async def process(self, batch, port):
        x = np.asarray(batch.tensors["x"])
        if len(self.held) < self.config.max_held and holds(self.config.seed, batch.batch_id, self.config.rate):
            self.held.append(x.tolist())
            return flowrl.Drop("held", replace=True)
        out = np.concatenate([np.asarray(h, dtype=np.int64) for h in self.held] + [x])
        self.held = []
        return batch.replace(tensors={"x": out})

    def state_dict(self):
        return {"held": [list(h) for h in self.held]}

    def load_state_dict(self, state):
        self.held = [list(h) for h in state["held"]]


class Merge(flowrl.Join):
    """Join of two branches: x = concat(a.x, b.x)."""

    inputs = ("a", "b")

    async def join(self, batches):
        a, b = batches["a"], batches["b"]
        return a.replace(tensors={"x": np.concatenate([np.asarray(a.tensors["x"]), np.asarray(b.tensors["x"])])})


class _Folding:
    """The hash-chain state shared by `Fold` and `FoldSink`."""

    class Config(flowrl.NodeConfig):
        history: int = 100_000
        """Indices kept in the state (the last ones): enough to say which ticket went missing."""

    async def setup(self):
        self.chain, self.count, self.indices = EMPTY_CHAIN, 0, []

    def fold(self, batch) -> None:
        self.chain = fold_state(self.chain, batch.batch_id, np.asarray(batch.tensors["x"]))
        self.count += 1
        self.indices.append(index_of(batch))
        if len(self.indices) > self.config.history:
            del self.indices[: len(self.indices) - self.config.history]

    def state_dict(self):
        return {"chain": self.chain, "count": self.count, "indices": list(self.indices)}

    def load_state_dict(self, state):
        self.chain, self.count, self.indices = state["chain"], int(state["count"]), list(state["indices"])


class Fold(_Folding, flowrl.Node):
    """Stateful transform: folds every batch into its hash chain, forwards it unchanged."""

    stateful = True
    Config = _Folding.Config

    async def process(self, batch, port):
        self.fold(batch)
        return batch


class FoldSink(_Folding, flowrl.Sink):
    """Stateful sink: folds every batch into its hash chain."""

    stateful = True
    Config = _Folding.Config

    async def process(self, batch, port):
        self.fold(batch)
        self.ctx.recorder.count("chaos_samples", batch.num_samples, per_node=True)


class LogSink(flowrl.Sink):
    """Stateless sink (a logger, an evaluator): counts samples, keeps nothing between batches."""

    async def process(self, batch, port):
        self.ctx.recorder.count("chaos_samples", batch.num_samples, per_node=True)


KINDS = {cls.__name__: f"{__name__}:{cls.__name__}"
         for cls in (TicketSource, Mix, Drop, Shrink, Hold, Merge, Fold, FoldSink, LogSink)}
"""Class name -> the `kind` string a graph file uses."""
