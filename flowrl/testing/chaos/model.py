"""What a fault-free run of a shape must produce, computed from the shape alone (no processes).

    expected = simulate(shape)
    expected.states["fold"]          # {"chain": ..., "count": ..., "indices": [...]}: FoldSink / Fold state
    expected.states["rsink/rank1"]   # rank 1's state of a data-parallel stateful node (its shards)
    expected.outcomes["sink"][7]     # "consumed" or "dropped": what sink `sink` records for ticket 7
    expected.reached["mix"]          # ticket indices that reach `mix`'s process
    expected.calls["sink"]           # its calls, by first ticket (to aim faults: `@step=N` counts calls)

Semantics assumed (the runtime's contract): a node returning None drops the ticket and the drop
flows on as a marker; a join whose inputs include a drop marker drops the ticket; a stateful node
folds every ticket that reaches it exactly once, in index order, and never a dropped one; a sink
records each ticket once, as consumed or as dropped.

Ragged shapes (`shape.ragged`: the source's `ragged` config): every value is `x` and the lengths of
`r` (sample i of `r` is x_i repeated that many times), which follow the samples through selects,
concats and held batches; the chains fold the lengths too (`nodes.fold_state`), and a `Hold`
node's state keeps them.

Data-parallel nodes: the runtime splits a batch into contiguous shards, one per rank, of near-equal
samples or, ragged, near-equal tokens (`nodes.rank_bounds`); each rank of a stateful one folds its own
shard (an empty one too) and the digests of every rank's shard, for every ticket that reaches the
node. `RMix`'s output does not depend on the number of ranks (its collective sums the whole batch).

Group tickets (`shape.groups`, `schedule.ticket: group`): a ticket is one sample; a stateful sink
folds the G = `batch_size` tickets of update u in one call, their values concatenated in ticket
order with the dropped ones left out, as `nodes.update_id(u)` (no call when all were dropped);
stateful transforms fold ticket by ticket. A node's `concurrency` changes nothing here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from flowrl.testing.chaos import nodes as N


def default_batch_id(index: int) -> str:
    """The scheduler's batch id of ticket `index` (run id `t`)."""
    return f"t-{index:06d}"


@dataclass
class Expected:
    states: dict[str, dict] = field(default_factory=dict)
    outcomes: dict[str, dict[int, str]] = field(default_factory=dict)
    reached: dict[str, list[int]] = field(default_factory=dict)
    """Per node, the tickets that reach it (not as a drop marker), in index order."""
    calls: dict[str, list[int]] = field(default_factory=dict)
    """Per node, its calls (what a fault's `@step=N` counts), each as the index of the first ticket
    it takes: the tickets that reach it, except for a stateful sink of a `ticket: group` shape,
    which makes one call per update that any of its tickets reaches."""
    total: int = 0
    """Tickets the run issues: the shape's steps plus one per replaced ticket."""


DROP, REPLACE = "drop", "replace"
"""Drop markers in the simulation: a plain drop, and one that asks for a replacement ticket."""


def simulate(shape, batch_id: Callable[[int], str] = default_batch_id) -> Expected:
    """Run `shape` (a `flowrl.testing.chaos.shapes.Shape`) in this process, ticket by ticket."""
    out = Expected()
    chains = {N.rank_state_key(name, r): N.EMPTY_CHAIN for name, d in shape.nodes.items() if d.stateful
              for r in range(d.ranks)}
    counts = {name: 0 for name in chains}
    indices: dict[str, list[int]] = {name: [] for name in chains}
    held: dict[str, list[tuple]] = {name: [] for name, d in shape.nodes.items() if d.cls == "Hold"}
    per = shape.tickets_per_update
    updates: dict[str, list[tuple]] = {d.name: [] for d in shape.nodes.values() if per > 1 and d.sink and d.stateful}
    """A `ticket: group` shape's stateful sinks: (x, lengths) of the live tickets of the update so far."""

    def fold(d, bid: str, x, lens, index: int) -> None:
        if d.cls == "Hold":
            return
        if d.cls not in ("RFold", "RFoldSink", "RTrainer"):
            chains[d.name] = N.fold_state(chains[d.name], bid, x, lens)
            counts[d.name] += 1
            indices[d.name].append(index)
            return
        bounds = N.rank_bounds(len(x), d.ranks, lens)  # per rank: its shard, every shard's digest
        shards = [(x[a:b], None if lens is None else lens[a:b]) for a, b in bounds]
        digests = [N.shard_digest(*sh) for sh in shards]
        for r, (sx, sl) in enumerate(shards):
            key = N.rank_state_key(d.name, r)
            chains[key] = N.rank_fold_state(chains[key], bid, sx, digests, sl)
            counts[key] += 1
            indices[key].append(index)

    for d in shape.nodes.values():
        out.reached[d.name] = []
        out.calls[d.name] = []
        if d.sink:
            out.outcomes[d.name] = {}
    replaced, i = 0, 0
    while i < shape.tickets + replaced:
        bid = batch_id(i)
        value: dict[str, tuple | str] = {}  # (x, r's lengths or None), or a drop marker
        asks = False  # a sink got a marker asking for a replacement
        for d in shape.nodes.values():  # topological order
            ins = [value[p] for p in d.inputs.values()]
            markers = [x for x in ins if isinstance(x, str)]
            if markers:
                value[d.name] = REPLACE if REPLACE in markers else DROP
                if d.sink:
                    out.outcomes[d.name][i] = "dropped"
                    asks |= value[d.name] == REPLACE
                continue
            out.reached[d.name].append(i)
            if d.name not in updates:
                out.calls[d.name].append(i)
            cfg = d.config
            x, lens = ins[0] if ins else (None, None)
            if d.cls == "TicketSource":
                x = N.source_values(cfg.get("seed", 0), i, shape.ticket_size)
                lens = N.ragged_lengths(x) if cfg.get("ragged") else None
            elif d.cls == "Mix":
                x = N.mix_values(x, cfg.get("mul", 3), cfg.get("add", 1))
            elif d.cls == "Drop":
                x = DROP if N.drops(cfg.get("seed", 0), bid, cfg.get("rate", 0.25)) else x
            elif d.cls == "Shrink":
                keep = N.shrink_mask(x, cfg.get("seed", 0))
                x, lens = x[keep], None if lens is None else lens[keep]
            elif d.cls == "Hold":
                if len(held[d.name]) < cfg.get("max_held", 2) and N.holds(cfg.get("seed", 0), bid, cfg.get("rate", 0.3)):
                    held[d.name].append((x, lens))
                    x = REPLACE
                else:
                    x, lens = _cat([*held[d.name], (x, lens)])
                    held[d.name] = []
            elif d.cls == "Merge":
                x, lens = _cat([value[d.inputs["a"]], value[d.inputs["b"]]])
            elif d.cls == "RMix":
                x = N.rmix_values(x, cfg.get("mul", 3), cfg.get("add", 1))
            elif d.cls == "RSub":
                x = N.rmix_values(x, cfg.get("mul", 5), cfg.get("add", 2))
            elif d.cls == "Sub":
                x = N.mix_values(x, cfg.get("mul", 5), cfg.get("add", 2))
            elif d.cls not in ("Fold", "FoldSink", "LogSink", "RFold", "RFoldSink", "RTrainer"):
                raise ValueError(f"node {d.name!r}: unknown synthetic class {d.cls!r}")
            if isinstance(x, str):  # this node dropped the ticket
                value[d.name] = x
                continue
            if d.name in updates:  # a trainer's update: its tickets' batches together, folded below
                updates[d.name].append((x, lens))
            elif d.stateful:
                fold(d, bid, x, lens, i)
            if d.sink:
                out.outcomes[d.name][i] = "consumed"
            value[d.name] = (x, lens)
        if asks and replaced < shape.steps:  # the scheduler adds one ticket, at most `steps` in all
            replaced += 1
        if updates and (i % per == per - 1 or i + 1 == shape.tickets + replaced):  # the update's last ticket
            u = i // per
            for name, live in updates.items():
                if live:  # one call, the live tickets' batches concatenated; none when all were dropped
                    fold(shape.nodes[name], N.update_id(u), *_cat(live), u)
                    out.calls[name].append(u * per)
                updates[name] = []
        i += 1
    out.total = shape.tickets + replaced
    for name, chain in chains.items():
        if name in held:
            out.states[name] = {"held": [hx.tolist() for hx, _ in held[name]]}
            if shape.nodes[name].config.get("ragged"):
                out.states[name]["lengths"] = [hl.tolist() for _, hl in held[name]]
        else:
            out.states[name] = {"chain": chain, "count": counts[name], "indices": indices[name]}
    for name, d in shape.nodes.items():
        if d.ranks > 1 and d.stateful:  # saved by a collective: every rank's count, the same on each
            for r in range(d.ranks):
                out.states[N.rank_state_key(name, r)]["counts"] = [counts[name]] * d.ranks
    return out


def _cat(parts: list[tuple]) -> tuple:
    """(x, lengths) of samples of several values, in order (lengths None when not ragged)."""
    x = np.concatenate([p[0] for p in parts])
    lens = None if parts[0][1] is None else np.concatenate([p[1] for p in parts])
    return x, lens
