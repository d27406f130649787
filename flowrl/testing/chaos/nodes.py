"""Synthetic nodes for shape x fault tests: deterministic, cheap, no model, no sleeps (but a
source's optional pace).

    TicketSource -> Mix -> Fold (stateful) -> Drop -> Merge.a ... -> FoldSink (stateful), LogSink

`Hold` (stateful, like a DAPO filter) holds some tickets' batches and drops them with
`replace=True`; the runtime then issues one more ticket, and the held values go out in front of
the next batch the node passes on.

Data-parallel nodes (`devices: 2` or 3: one process per rank, rank 0 splits each batch into
shards) run a real collective over the node's gloo group inside `process`, as a DDP/FSDP trainer
does: `RMix` all-reduces the shard sums (so its output depends on every rank's shard), `RFold` /
`RFoldSink` all-gather the shard digests and fold them into a per-rank hash chain, and `RTrainer`
(a stateful sink that publishes weights) also all-gathers its weights on every rank at each
publish, like a DTensor trainer's `full_tensor()`. `Sub` (stateless, replicable) subscribes to
them and checks that every version it receives is whole: the label and every rank's part agree;
`RSub` is a data-parallel `Sub` whose `process` is `RMix`'s.

Stateless nodes with `concurrency` > 1 (configured `linger_s`) let their calls overlap
(`Overlapping`: a call waits a moment for a partner, then yields; the output does not change). A
stateful sink configured `per_update: G` (a `schedule.ticket: group` shape) takes an update's tickets
in one call, concatenated, and folds it as `update_id(u)`.

Every batch is `x`: int64[size] plus `meta["ix"]`, the ticket index; in a ragged shape (the source's
`ragged: true`) also `r`, a `flowrl.Ragged` aligned with `x`: sample i of `r` is x_i repeated L_i
times, L_i = 1 + (the source's x_i mod 7). Nodes that map `x` elementwise rewrite `r` from the new
`x` with the same offsets (`with_x`); `Shrink`'s select, `Merge`'s concat, `Hold`'s held samples and
the runtime's token-balanced shards of data-parallel nodes keep it aligned. Every node checks an `r`
it gets against its `x` (`ragged_problem`), and a stateful node or sink configured `ragged: true`
also requires one; a mismatch raises, naming the node and the batch.

Every output is a pure function of the input, so what each node should see is known from the graph
alone (`flowrl.testing.chaos.model` computes it). A stateful node's state is a hash chain over
(batch id, digest of the batch's content: `x` and, in a ragged shape, `r`'s lengths) in the order it
folded them, plus the indices it folded: after any crash, equal to a fault-free run's state bitwise
only if it saw each ticket exactly once, in index order.

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


def content_digest(batch_id: str, x: np.ndarray, lengths: np.ndarray | None = None) -> bytes:
    """Digest of a batch's content: its id, `x` and, in a ragged shape, `r`'s lengths (a sample lost
    or repeated in `r` alone changes it too)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(batch_id.encode())
    h.update(np.ascontiguousarray(x, dtype=np.int64).tobytes())
    if lengths is not None:
        h.update(b"r")
        h.update(np.ascontiguousarray(lengths, dtype=np.int64).tobytes())
    return h.digest()


def fold_state(chain: str, batch_id: str, x: np.ndarray, lengths: np.ndarray | None = None) -> str:
    """One step of a stateful node's hash chain."""
    return hashlib.blake2b(bytes.fromhex(chain) + content_digest(batch_id, x, lengths), digest_size=16).hexdigest()


# --- ragged batches: `r` next to `x` ------------------------------------------------------------

MAX_LEN = 7
"""A ragged sample holds 1..MAX_LEN tokens."""


def ragged_lengths(x: np.ndarray) -> np.ndarray:
    """Tokens of each sample of a ragged source batch: 1 + x_i mod 7 (1..7, per sample)."""
    return 1 + np.asarray(x, dtype=np.int64) % MAX_LEN


def ragged_of(x: np.ndarray, lengths: np.ndarray):
    """`r` for `x`: sample i is x_i repeated lengths_i times (numpy values and offsets)."""
    import flowrl

    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return flowrl.Ragged(np.repeat(np.asarray(x, dtype=np.int64), lengths), offsets)


def _host(a) -> np.ndarray:
    return a.detach().cpu().numpy() if hasattr(a, "detach") else np.asarray(a)


def lengths_of(batch) -> np.ndarray | None:
    """`r`'s lengths (int64 numpy), or None when the batch has no `r`."""
    r = batch.tensors.get("r")
    return None if r is None else _host(r.offsets[1:] - r.offsets[:-1]).astype(np.int64, copy=False)


def ragged_problem(batch, required: bool = False) -> str | None:
    """What is wrong with the batch's `r` for its `x`, or None: `r` must be a Ragged of as many
    samples as `x`, with valid offsets, lengths 1..7 and values x_i repeated (and, `required`,
    be there at all)."""
    import flowrl
    from flowrl.transport.ragged import offsets_problem

    r = batch.tensors.get("r")
    if r is None:
        return f"no ragged tensor 'r' (has {sorted(batch.tensors)})" if required else None
    if type(r) is not flowrl.Ragged:
        return f"'r' is a {type(r).__name__}, not a Ragged"
    problem = offsets_problem(r.values, r.offsets)
    if problem:
        return f"'r' has bad offsets: {problem}"
    x = np.asarray(batch.tensors["x"], dtype=np.int64)
    if r.num_samples != len(x):
        return f"'r' has {r.num_samples} samples, 'x' {len(x)}"
    lengths = lengths_of(batch)
    if len(lengths) and (lengths.min() < 1 or lengths.max() > MAX_LEN):
        return f"'r' has sample lengths {lengths.tolist()}, each must be 1..{MAX_LEN}"
    values = _host(r.values)
    if values.ndim != 1 or values.dtype != np.int64:
        return f"'r' values are {values.dtype}{list(values.shape)}, want int64[tokens]"
    wrong = np.flatnonzero(values != np.repeat(x, lengths))
    if wrong.size:
        sample = int(np.searchsorted(_host(r.offsets), wrong[0], side="right")) - 1
        return f"'r' values are not x repeated by its lengths: sample {sample} differs"
    return None


class RaggedMismatch(RuntimeError):
    """A batch whose `r` is not consistent with its `x` (raised by the node that got it)."""


def node_name(node) -> str:
    return getattr(node.ctx, "name", None) or type(node).__name__


def check_ragged(node, batch, required: bool = False) -> None:
    """Raise `RaggedMismatch` naming the node and the batch when `ragged_problem` finds something."""
    problem = ragged_problem(batch, required)
    if problem is not None:
        raise RaggedMismatch(f"node {node_name(node)!r}: batch {batch.batch_id} (ticket {batch.meta.get('ix')}, "
                             f"attempt {batch.attempt}): {problem}")


def with_x(batch, x: np.ndarray):
    """`batch` with `x` replaced and, if it has `r`, `r` rewritten from the new `x` with the same
    offsets (`np.repeat(x, r.lengths)`): what every node that maps `x` elementwise returns."""
    tensors = {**batch.tensors, "x": x}
    r = tensors.get("r")
    if r is not None:
        tensors["r"] = r.like(np.repeat(np.asarray(x, dtype=np.int64), lengths_of(batch)))
    return batch.replace(tensors=tensors)


EMPTY_CHAIN = "00" * 16


def index_of(batch) -> int:
    return int(batch.meta["ix"])


def update_id(update: int) -> str:
    """What a stateful sink of a `schedule.ticket: group` shape folds as the id of update `update`
    (one call with the batches of its tickets concatenated)."""
    return f"u-{update:06d}"


OVERLAP = "CHAOS-OVERLAP"
"""What a node with `linger_s` logs each time more of its calls than ever before are in flight
together (`CHAOS-OVERLAP 3 calls in flight`; the trial reads the logs for it)."""


class Overlapping:
    """Calls that overlap when they get the chance, like a continuous engine's (a node with
    `concurrency` > 1, configured `linger_s` > 0): a call that finds no other call of this process
    in flight waits for one, at most `linger_s`, then every call yields to the loop a few times
    (an engine's iterations, in which the others advance too). Nothing is ordered by the wait and
    the output does not depend on it: it only lets several calls be in flight at once, so that a
    fault or a recovery finds calls mid-way. With `linger_s` 0 (the default) it does nothing."""

    preload = ()  # numpy only (the runtime adds torch where it uses it: checkpoints, weights, ranks)

    async def overlap(self) -> None:
        linger = getattr(self.config, "linger_s", 0.0)
        if not linger:
            return
        import asyncio
        import contextlib

        if getattr(self, "_flight", None) is None:
            self._flight, self._most, self._joined = 0, 1, asyncio.Event()
        self._flight += 1
        if self._flight > self._most:
            self._most = self._flight
            self.ctx.log.info("%s %d calls in flight", OVERLAP, self._most)
        try:
            if self._flight > 1:
                self._joined.set()  # the one waiting for a partner goes on
            else:
                self._joined = asyncio.Event()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._joined.wait(), linger)
            for _ in range(4):
                await asyncio.sleep(0)  # a yield, not a delay: the other calls run in between
        finally:
            self._flight -= 1


class TicketSource(Overlapping, flowrl.Source):
    """Ticket i -> x = source_values(seed, i, ticket.size)."""

    class Config(flowrl.NodeConfig):
        seed: int = 0
        """Seeds the content (a node's seed, not the graph's: it is part of the shape)."""
        pace_s: float = 0.0
        """Seconds per ticket on average (shapes for scale events: the run lasts long enough for
        `flowrl scale` to start and stop replicas while it goes on). The content does not change."""
        burst: int = 1
        """With `pace_s`: tickets come in bursts of this many (a wait of `pace_s * burst` before each
        burst), so that several are still in flight at once, as in an unpaced run."""
        ragged: bool = False
        """Batches carry `r` too: sample i is x_i repeated 1 + (x_i mod 7) times (`ragged_of`)."""
        linger_s: float = 0.0
        """With `concurrency` > 1: a call waits at most this long for another call to be in flight
        with it (`Overlapping`); 0: no wait."""

    async def generate(self, ticket):
        if self.config.pace_s and ticket.index % max(1, self.config.burst) == 0:
            import anyio

            await anyio.sleep(self.config.pace_s * max(1, self.config.burst))
        await self.overlap()
        x = source_values(self.config.seed, ticket.index, ticket.size)
        tensors = {"x": x, "r": ragged_of(x, ragged_lengths(x))} if self.config.ragged else {"x": x}
        return flowrl.Batch(tensors=tensors, meta={"ix": ticket.index})


class Mix(Overlapping, flowrl.Node):
    """Stateless transform: x -> (x * mul + add) mod MOD."""

    class Config(flowrl.NodeConfig):
        mul: int = 3
        add: int = 1
        linger_s: float = 0.0
        """With `concurrency` > 1: a call waits at most this long for another call to be in flight
        with it (`Overlapping`); 0: no wait."""

    async def process(self, batch, port):
        check_ragged(self, batch)
        await self.overlap()
        return with_x(batch, mix_values(np.asarray(batch.tensors["x"]), self.config.mul, self.config.add))


class Drop(Overlapping, flowrl.Node):
    """Filter: drops a ticket (returns None) when a hash of its batch id and `seed` says so."""

    class Config(flowrl.NodeConfig):
        seed: int = 0
        rate: float = 0.25
        """Fraction of tickets dropped (by hash, so the same ones in every run)."""
        linger_s: float = 0.0
        """With `concurrency` > 1: a call waits at most this long for another call to be in flight
        with it (`Overlapping`); 0: no wait."""

    async def process(self, batch, port):
        check_ragged(self, batch)
        await self.overlap()
        if drops(self.config.seed, batch.batch_id, self.config.rate):
            return None
        return batch


class Shrink(Overlapping, flowrl.Node):
    """Filter: keeps about half of a batch's samples (by a hash of their values), never none."""

    class Config(flowrl.NodeConfig):
        seed: int = 0
        linger_s: float = 0.0
        """With `concurrency` > 1: a call waits at most this long for another call to be in flight
        with it (`Overlapping`); 0: no wait."""

    async def process(self, batch, port):
        check_ragged(self, batch)
        await self.overlap()
        return batch.select(shrink_mask(np.asarray(batch.tensors["x"]), self.config.seed))


class Hold(flowrl.Node):
    """Stateful filter: holds the batch of a ticket that `holds(seed, batch id, rate)` picks (at most
    `max_held` in a row), dropping the ticket with `replace=True`; the next batch it passes on
    carries every held value in front of its own (and, `ragged`, their `r` lengths: its state keeps
    them as plain lists, `lengths`, one per held batch)."""

    preload = ()

    stateful = True

    class Config(flowrl.NodeConfig):
        seed: int = 0
        rate: float = 0.3
        max_held: int = 2
        ragged: bool = False
        """Batches must carry `r` (checked); the held ones' lengths are part of the state."""

    async def setup(self):
        self.held: list[list[int]] = []
        self.lengths: list[list[int]] = []

    async def process(self, batch, port):
        check_ragged(self, batch, self.config.ragged)
        x = np.asarray(batch.tensors["x"])
        lengths = lengths_of(batch)
        if len(self.held) < self.config.max_held and holds(self.config.seed, batch.batch_id, self.config.rate):
            self.held.append(x.tolist())
            if lengths is not None:
                self.lengths.append(lengths.tolist())
            return flowrl.Drop("held", replace=True)
        out = np.concatenate([np.asarray(h, dtype=np.int64) for h in self.held] + [x])
        tensors = {"x": out}
        if lengths is not None:
            if len(self.lengths) != len(self.held):
                raise RaggedMismatch(f"node {node_name(self)!r}: batch {batch.batch_id} carries 'r' but "
                                     f"{len(self.held) - len(self.lengths)} held batches did not")
            tensors["r"] = ragged_of(out, np.concatenate([np.asarray(n, dtype=np.int64) for n in self.lengths]
                                                         + [lengths]))
        self.held, self.lengths = [], []
        return batch.replace(tensors=tensors)

    def state_dict(self):
        state = {"held": [list(h) for h in self.held]}
        if self.config.ragged or self.lengths:
            state["lengths"] = [list(n) for n in self.lengths]
        return state

    def load_state_dict(self, state):
        self.held = [list(h) for h in state["held"]]
        self.lengths = [list(n) for n in state.get("lengths", [])]


class Merge(Overlapping, flowrl.Join):
    """Join of two branches: x = concat(a.x, b.x)."""

    inputs = ("a", "b")

    class Config(flowrl.NodeConfig):
        linger_s: float = 0.0
        """With `concurrency` > 1: a call waits at most this long for another call to be in flight
        with it (`Overlapping`); 0: no wait."""

    async def join(self, batches):
        a, b = batches["a"], batches["b"]
        check_ragged(self, a)
        check_ragged(self, b)
        await self.overlap()
        tensors = {"x": np.concatenate([np.asarray(a.tensors["x"]), np.asarray(b.tensors["x"])])}
        if ("r" in a.tensors) != ("r" in b.tensors):
            raise RaggedMismatch(f"node {node_name(self)!r}: batch {a.batch_id}: 'r' on input "
                                 f"{'a' if 'r' in a.tensors else 'b'} only")
        if "r" in a.tensors:
            tensors["r"] = flowrl.Ragged.concat([a.tensors["r"], b.tensors["r"]])
        return a.replace(tensors=tensors)


class _Folding:
    """The hash-chain state shared by `Fold` and `FoldSink` (and, one chain per rank, `RFold`, `RFoldSink`)."""

    preload = ()

    class Config(flowrl.NodeConfig):
        history: int = 100_000
        """Indices kept in the state (the last ones): enough to say which ticket went missing."""
        ragged: bool = False
        """Every batch must carry `r`, consistent with `x` (else it raises, naming the node and
        the batch); the chain folds `r`'s lengths too."""
        per_update: int = 1
        """Tickets per training update (a stateful sink of a `schedule.ticket: group` shape): each
        call is one update, the batches of its tickets concatenated (dropped ones left out); the
        chain folds it as `update_id(batch.index // per_update)` and `indices` holds update numbers."""

    async def setup(self):
        self.chain, self.count, self.indices = EMPTY_CHAIN, 0, []

    def fold(self, batch) -> None:
        check_ragged(self, batch, self.config.ragged)
        per = self.config.per_update
        bid, ix = (update_id(batch.index // per), batch.index // per) if per > 1 else (batch.batch_id, index_of(batch))
        self.chain = self.next_chain(batch, bid)
        self.count += 1
        self.indices.append(ix)
        if len(self.indices) > self.config.history:
            del self.indices[: len(self.indices) - self.config.history]

    def state_dict(self):
        return {"chain": self.chain, "count": self.count, "indices": list(self.indices)}

    def load_state_dict(self, state):
        self.chain, self.count, self.indices = state["chain"], int(state["count"]), list(state["indices"])

    def next_chain(self, batch, bid: str) -> str:
        return fold_state(self.chain, bid, np.asarray(batch.tensors["x"]), lengths_of(batch))


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


class LogSink(Overlapping, flowrl.Sink):
    """Stateless sink (a logger, an evaluator): counts samples, keeps nothing between batches (and,
    `ragged`, checks `r` as `FoldSink` does)."""

    class Config(flowrl.NodeConfig):
        ragged: bool = False
        linger_s: float = 0.0
        """With `concurrency` > 1: a call waits at most this long for another call to be in flight
        with it (`Overlapping`); 0: no wait."""

    async def process(self, batch, port):
        check_ragged(self, batch, self.config.ragged)
        await self.overlap()
        self.ctx.recorder.count("chaos_samples", batch.num_samples, per_node=True)


# --- data-parallel nodes: a collective inside `process` -----------------------------------------

def rank_bounds(n: int, parts: int, lengths: np.ndarray | None = None) -> list[tuple[int, int]]:
    """[start, stop) of each rank's shard of an n-sample batch, as the runtime splits it
    (`Batch.split(parts, by_tokens=True)`; chaos batches have no prompt groups): contiguous.

    Without `r` (`lengths` None), or with no tokens, near-equal counts, the first ranks one larger.
    With `r`, near-equal tokens: rank k (of the ranks but the last) takes samples while it has none,
    or while its tokens so far plus half the next sample's stay within the tokens left divided by
    the ranks left, and never so many that a later rank would get no sample while there are
    enough; the last rank takes the rest. A rank may get no sample (n < parts)."""
    total = 0 if lengths is None else int(np.asarray(lengths, dtype=np.int64).sum())
    if lengths is None or n == 0 or total == 0:
        base, extra = divmod(n, parts)
        cuts = [0] + [r * base + min(r, extra) for r in range(1, parts + 1)]
    else:
        w = np.asarray(lengths, dtype=np.int64)
        cuts, start, left_tokens = [0], 0, float(total)
        for r in range(parts - 1):
            ranks_left = parts - r
            share = left_tokens / ranks_left
            limit = max(start, n - (ranks_left - 1))
            stop, took = start, 0.0
            while stop < limit and (stop == start or took + w[stop] / 2 <= share):
                took += float(w[stop])
                stop += 1
            cuts.append(stop)
            start, left_tokens = stop, left_tokens - took
        cuts.append(n)
    return [(int(a), int(b)) for a, b in zip(cuts, cuts[1:])]


def rmix_values(x: np.ndarray, mul: int, add: int) -> np.ndarray:
    """`RMix` on a whole batch: x -> (x * mul + add + sum(x)) mod MOD. The sum is all-reduced over the
    ranks' shards, so the result is the same for any number of ranks."""
    total = int(np.asarray(x, dtype=np.int64).sum() % MOD)
    return (x * mul + add + total) % MOD


def shard_digest(x: np.ndarray, lengths: np.ndarray | None = None) -> int:
    """A 62-bit digest of a shard's values and, ragged, its `r` lengths (what the ranks all-gather)."""
    h = hashlib.blake2b(np.ascontiguousarray(x, dtype=np.int64).tobytes(), digest_size=8)
    if lengths is not None:
        h.update(b"r" + np.ascontiguousarray(lengths, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little") >> 2


def rank_fold_state(chain: str, batch_id: str, shard: np.ndarray, digests: list[int],
                    lengths: np.ndarray | None = None) -> str:
    """One step of a data-parallel stateful node's per-rank chain: its own shard (and its `r`
    lengths), and every rank's shard digest (gathered: the state depends on every rank)."""
    h = hashlib.blake2b(bytes.fromhex(chain) + content_digest(batch_id, shard, lengths), digest_size=16)
    h.update(np.asarray(digests, dtype=np.int64).tobytes())
    return h.hexdigest()


def rank_state_key(node: str, rank: int) -> str:
    """Where a rank's state goes in the model and the checker: the node's name for rank 0 (as for
    any node), `node/rank1`, `node/rank2` for the others."""
    return node if rank == 0 else f"{node}/rank{rank}"


def _collective_group(ctx) -> bool:
    if ctx.world_size <= 1:
        return False
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(f"node {ctx.name!r} runs {ctx.world_size} ranks but torch.distributed has no group")
    return True


def all_reduce_sum(ctx, value: int) -> int:
    """`value` summed over the node's ranks (an all-reduce over its gloo group)."""
    if not _collective_group(ctx):
        return value
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


def all_gather_ints(ctx, values: list[int]) -> list[list[int]]:
    """Every rank's `values` (the same length on each), in rank order (an all-gather)."""
    if not _collective_group(ctx):
        return [list(values)]
    import torch
    import torch.distributed as dist

    mine = torch.tensor(values, dtype=torch.int64)
    out = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]


class RMix(flowrl.Node):
    """Stateless, data parallel: all-reduces the sum of the shards, then x -> (x * mul + add + sum)
    mod MOD on each shard (`rmix_values` on the whole batch)."""

    class Config(flowrl.NodeConfig):
        mul: int = 3
        add: int = 1

    async def process(self, batch, port):
        check_ragged(self, batch)
        x = np.asarray(batch.tensors["x"], dtype=np.int64)
        total = all_reduce_sum(self.ctx, int(x.sum() % MOD)) % MOD
        return with_x(batch, (x * self.config.mul + self.config.add + total) % MOD)


class _RankFolding(_Folding):
    """State of a data-parallel stateful node, one per rank: a hash chain over (batch id, this rank's
    shard, every rank's shard digest, all-gathered), its count and the indices it folded. Saving it
    is a collective too (like a sharded trainer's checkpoint): it gathers every rank's count, so
    every rank must save at the same ticket."""

    def next_chain(self, batch, bid: str) -> str:
        x = np.asarray(batch.tensors["x"], dtype=np.int64)
        lengths = lengths_of(batch)
        digests = [d[0] for d in all_gather_ints(self.ctx, [shard_digest(x, lengths)])]
        return rank_fold_state(self.chain, bid, x, digests, lengths)

    def state_dict(self):
        counts = [c[0] for c in all_gather_ints(self.ctx, [self.count])]
        return {**super().state_dict(), "counts": counts}


class RFold(_RankFolding, Fold):
    """Stateful transform, data parallel: folds its shard (and the gathered digests), forwards it."""


class RFoldSink(_RankFolding, FoldSink):
    """Stateful sink, data parallel: folds its shard (and the gathered digests)."""


PART = 4
"""int64 values per rank in `RTrainer`'s weights: [version, count, chain head, rank]."""


class _GatheredWeights:
    """`RTrainer.weights()`: the layout without communication (`items`), the full tensor by an
    all-gather of every rank's part (`[name]`, rank 0's publisher), and the same all-gather with
    nothing kept (`drain`, the other ranks) — the shape of `flowrl.rl.FullState`."""

    def __init__(self, node):
        self.node = node

    def _part(self) -> list[int]:
        n = self.node
        return [int(n.ctx.policy_version), int(n.count), int(n.chain[:15], 16), int(n.ctx.rank)]

    def items(self):
        import torch

        return [("w", torch.empty(PART * self.node.ctx.world_size, dtype=torch.int64, device="meta"))]

    def keys(self):
        return ["w"]

    def __iter__(self):
        return iter(self.keys())

    def __len__(self):
        return 1

    def __getitem__(self, name):
        import torch

        if name != "w":
            raise KeyError(name)
        parts = all_gather_ints(self.node.ctx, self._part())
        return torch.tensor([v for p in parts for v in p], dtype=torch.int64)

    def drain(self) -> None:
        all_gather_ints(self.node.ctx, self._part())


class RTrainer(RFoldSink):
    """A data-parallel stateful sink that publishes weights after every ticket, gathered from every
    rank (each rank's part says its version, count, chain head and rank)."""

    publishes_weights = True
    Config = _RankFolding.Config

    def weights(self):
        return _GatheredWeights(self)


WEIGHT_MISMATCH = "CHAOS-WEIGHTS-MISMATCH"
"""What `Sub` logs when a version it received is not whole (the checker reads the logs for it)."""


def weight_problem(w: list[int], version: int, ranks: int) -> str | None:
    """Why the weights `w` (`RTrainer`'s, gathered from `ranks` ranks) are not version `version`."""
    parts = [w[r * PART:(r + 1) * PART] for r in range(ranks)]
    if [p[3] for p in parts] != list(range(ranks)):
        return f"rank fields {[p[3] for p in parts]}, want {list(range(ranks))}"
    if any(p[0] != version for p in parts):
        return f"labelled version {version}, the ranks' parts say versions {[p[0] for p in parts]}"
    if len({p[1] for p in parts}) != 1:
        return f"version {version}: the ranks had folded {[p[1] for p in parts]} tickets (not the same count)"
    return None


class _Subscribing:
    """A weight subscriber of `RTrainer`: every version it loads must be whole."""

    class Config(flowrl.NodeConfig):
        mul: int = 5
        add: int = 2
        ranks: int = 2
        """The publisher's ranks (its weights are int64[PART * ranks])."""
        linger_s: float = 0.0
        """With `concurrency` > 1: a call waits at most this long for another call to be in flight
        with it (`Overlapping`); 0: no wait."""

    async def setup(self):
        import torch

        self.w = torch.zeros(PART * self.config.ranks, dtype=torch.int64)

    def weights(self):
        return {"w": self.w}

    def load_weights(self, tensors, version):
        problem = weight_problem(self.w.tolist(), version, self.config.ranks)
        if problem is not None:
            self.ctx.log.error("%s %s: %s", WEIGHT_MISMATCH, self.ctx.name, problem)
            self.ctx.recorder.count("chaos_weight_mismatch", 1, per_node=True)


class Sub(Overlapping, _Subscribing, flowrl.Node):
    """Stateless transform that subscribes to `RTrainer`'s weights: x -> (x * mul + add) mod MOD
    whatever it holds (so the model does not depend on versions), and every version it takes must be
    whole (its label and every rank's part agree); if not, it logs `WEIGHT_MISMATCH`."""

    subscribes_weights = True
    Config = _Subscribing.Config

    async def process(self, batch, port):
        check_ragged(self, batch)
        await self.overlap()
        return with_x(batch, mix_values(np.asarray(batch.tensors["x"]), self.config.mul, self.config.add))


class RSub(_Subscribing, flowrl.Node):
    """`Sub` with data-parallel ranks (like a tensor/data-parallel rollout engine): every rank takes
    every version, and `process` is `RMix`'s (an all-reduce of the shard sums)."""

    subscribes_weights = True
    Config = _Subscribing.Config

    async def process(self, batch, port):
        check_ragged(self, batch)
        x = np.asarray(batch.tensors["x"], dtype=np.int64)
        total = all_reduce_sum(self.ctx, int(x.sum() % MOD)) % MOD
        return with_x(batch, (x * self.config.mul + self.config.add + total) % MOD)


KINDS = {cls.__name__: f"{__name__}:{cls.__name__}"
         for cls in (TicketSource, Mix, Drop, Shrink, Hold, Merge, Fold, FoldSink, LogSink,
                     RMix, RFold, RFoldSink, RTrainer, Sub, RSub)}
"""Class name -> the `kind` string a graph file uses."""
