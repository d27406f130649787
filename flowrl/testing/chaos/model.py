"""What a fault-free run of a shape must produce, computed from the shape alone (no processes).

    expected = simulate(shape)
    expected.states["fold"]          # {"chain": ..., "count": ..., "indices": [...]}: FoldSink / Fold state
    expected.outcomes["sink"][7]     # "consumed" or "dropped": what sink `sink` records for ticket 7
    expected.reached["mix"]          # ticket indices that reach `mix`'s process (to aim faults)

Semantics assumed (the runtime's contract): a node returning None drops the ticket and the drop
flows on as a marker; a join whose inputs include a drop marker drops the ticket; a stateful node
folds every ticket that reaches it exactly once, in index order, and never a dropped one; a sink
records each ticket once, as consumed or as dropped.
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


def simulate(shape, batch_id: Callable[[int], str] = default_batch_id) -> Expected:
    """Run `shape` (a `flowrl.testing.chaos.shapes.Shape`) in this process, ticket by ticket."""
    out = Expected()
    chains = {name: N.EMPTY_CHAIN for name, d in shape.nodes.items() if d.stateful}
    counts = {name: 0 for name in chains}
    indices: dict[str, list[int]] = {name: [] for name in chains}
    for d in shape.nodes.values():
        out.reached[d.name] = []
        if d.sink:
            out.outcomes[d.name] = {}
    for i in range(shape.steps):
        bid = batch_id(i)
        value: dict[str, np.ndarray | None] = {}
        for d in shape.nodes.values():  # topological order
            ins = [value[p] for p in d.inputs.values()]
            if any(x is None for x in ins):
                value[d.name] = None
                if d.sink:
                    out.outcomes[d.name][i] = "dropped"
                continue
            out.reached[d.name].append(i)
            cfg = d.config
            if d.cls == "TicketSource":
                x = N.source_values(cfg.get("seed", 0), i, shape.batch_size)
            elif d.cls == "Mix":
                x = N.mix_values(ins[0], cfg.get("mul", 3), cfg.get("add", 1))
            elif d.cls == "Drop":
                x = None if N.drops(cfg.get("seed", 0), bid, cfg.get("rate", 0.25)) else ins[0]
            elif d.cls == "Shrink":
                x = ins[0][N.shrink_mask(ins[0], cfg.get("seed", 0))]
            elif d.cls == "Merge":
                x = np.concatenate([value[d.inputs["a"]], value[d.inputs["b"]]])
            elif d.cls in ("Fold", "FoldSink", "LogSink"):
                x = ins[0]
            else:
                raise ValueError(f"node {d.name!r}: unknown synthetic class {d.cls!r}")
            if d.stateful:
                chains[d.name] = N.fold_state(chains[d.name], bid, x)
                counts[d.name] += 1
                indices[d.name].append(i)
            if d.sink:
                out.outcomes[d.name][i] = "consumed"
            value[d.name] = x
    for name, chain in chains.items():
        out.states[name] = {"chain": chain, "count": counts[name], "indices": indices[name]}
    return out
