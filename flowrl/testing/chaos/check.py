"""The checker: what a run of a shape must leave behind, against the model of the shape.

- ledger: for every issued ticket and every sink node, #consumed + #dropped - #rolled_back == 1
  (replicas of a sink count as that node), and consumed vs dropped as the model says;
- state: every stateful node's state in the final checkpoint equal, bitwise, to the model's (the
  hash chain over what it folded, in order) — which is also what a fault-free run must leave;
- outcome: exit 0; or a non-zero exit whose message names a node or a ticket ("failed, clear").

    problems = check_ledger(read_jsonl(run_dir / "ledger.jsonl"), shape.sinks, expected)
    step, states = read_final_states(run_dir)
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from flowrl.runtime.protocol.ledger import net_consumption
from flowrl.testing.chaos.model import Expected

MAX_LISTED = 8


@dataclass
class LedgerCheck:
    issued: int = 0
    lost: list[str] = field(default_factory=list)
    """`ticket@sink` with a net count of 0."""
    duplicated: list[str] = field(default_factory=list)
    """`ticket@sink` with a net count above 1."""
    wrong_outcome: list[str] = field(default_factory=list)
    """`ticket@sink: consumed, model says dropped` (or the other way)."""
    not_issued: list[int] = field(default_factory=list)
    """Ticket indices of the run that were never issued."""
    per_ticket: bool = False
    """The ledger records one `consumed` per ticket (the last sink), not one per (ticket, sink):
    an older runtime. Exactly-once per sink cannot be read from it."""

    def violations(self, complete: bool = True) -> list[str]:
        """What breaks exactly-once. A run that did not complete may miss tickets (not duplicate them)."""
        out = []

        def listed(name, items):
            if items:
                more = f" (+{len(items) - MAX_LISTED} more)" if len(items) > MAX_LISTED else ""
                out.append(f"{name}: {', '.join(map(str, items[:MAX_LISTED]))}{more}")

        if self.per_ticket:
            out.append("the ledger has one `consumed` per ticket, not one per (ticket, sink): "
                       "consumption per sink cannot be checked")
            return out
        listed("duplicated", self.duplicated)
        if complete:
            listed("lost", self.lost)
            listed("wrong outcome", self.wrong_outcome)
            listed("never issued", self.not_issued)
        return out


def check_ledger(rows: list[dict], sinks: list[str], expected: Expected | None = None,
                 steps: int | None = None) -> LedgerCheck:
    """Exactly-once per (ticket, sink) from `RUN_DIR/ledger.jsonl` rows, counted by the runtime's
    own rule (`net_consumption`: replicas count as their node, a `rolled_back` without `node`
    undoes the ticket's latest consumption)."""
    issued: dict[str, int] = {}
    for r in rows:
        if r.get("event") == "issued":
            issued.setdefault(r.get("batch_id"), r.get("index", -1))
    counts = net_consumption(rows)
    net = counts.net
    out = LedgerCheck(issued=len(issued))
    by_index = {i: b for b, i in issued.items()}
    for bid, index in sorted(issued.items(), key=lambda kv: kv[1]):
        for sink in sinks:
            n = net[(bid, sink)]
            if n < 1:
                out.lost.append(f"{bid}@{sink}")
            elif n > 1:
                out.duplicated.append(f"{bid}@{sink} x{n}")
            elif expected is not None and index in expected.outcomes.get(sink, {}):
                want = expected.outcomes[sink][index]
                got = "dropped" if counts.dropped[(bid, sink)] > counts.consumed[(bid, sink)] else "consumed"
                if got != want:
                    out.wrong_outcome.append(f"{bid}@{sink}: {got}, model says {want}")
    if steps is not None:
        out.not_issued = [i for i in range(steps) if i not in by_index]
    return out


def load_checkpoint_file(path: Path) -> dict:
    """One stateful node's checkpoint file -> the dict saved (its "node" key is the state_dict).
    The contract is `weights_only=True`; older runtimes pickled more, so fall back for them."""
    import pickle

    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        return torch.load(path, map_location="cpu", weights_only=False)


def state_key(proc_id: str) -> str:
    """`node/replica/rank` -> the model's key of its state: `node` (rank 0), `node/rankR` (see
    `nodes.rank_state_key`)."""
    from flowrl.testing.chaos.nodes import rank_state_key

    parts = proc_id.split("/")
    return rank_state_key(parts[0], int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else 0)


def read_final_states(run_dir: Path) -> tuple[int | None, dict[str, dict]]:
    """(step, {state key: state_dict}) of the last committed checkpoint, or (None, {}) when there is
    none. A data-parallel node has one state per rank: `node`, `node/rank1`, ..."""
    latest = Path(run_dir) / "checkpoints" / "latest.json"
    if not latest.exists():
        return None, {}
    record = json.loads(latest.read_text())
    states = {}
    for proc_id, rel in record.get("files", {}).items():
        states[state_key(proc_id)] = load_checkpoint_file(latest.parent / rel)["node"]
    return record.get("step"), states


def _runs(indices: list[int]) -> str:
    """[10, 11, 12, 14] -> '10-12, 14'."""
    out, start = [], None
    for i, x in enumerate(indices):
        if start is None:
            start = x
        if i + 1 == len(indices) or indices[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)


def compare_state(node: str, got: dict | None, want: dict) -> str | None:
    """None when equal bitwise; otherwise what differs, in ticket indices (missing, repeated, order)."""
    if got is None:
        return f"{node}: no state in the final checkpoint"
    if "held" in want:  # a Hold node: the values it still holds at the end (and, ragged, their r lengths)
        if got.get("held") != want["held"]:
            return f"{node}: holds {len(got.get('held', []))} batches at the end, the model {len(want['held'])}" + \
                ("" if len(got.get("held", [])) != len(want["held"]) else " (other values)")
        if got.get("lengths") != want.get("lengths"):
            return f"{node}: holds r lengths {got.get('lengths')}, the model {want.get('lengths')}"
        return None
    ranks = None
    if "counts" in want and got.get("counts") != want["counts"]:  # a data-parallel node's ranks at its save
        ranks = f"saved when its ranks had folded {got.get('counts')} tickets (want {want['counts']})"
    if got.get("chain") == want["chain"] and got.get("count") == want["count"]:
        return None if ranks is None else f"{node}: {ranks}"
    seen = list(got.get("indices", []))
    counts = Counter(seen)
    missing = sorted(set(want["indices"]) - set(seen))
    extra = sorted(set(seen) - set(want["indices"]))
    repeated = sorted(i for i, n in counts.items() if n > 1)
    parts = [f"count {got.get('count')} (want {want['count']})"]
    if missing:
        parts.append(f"missing tickets {_runs(missing)}")
    if repeated:
        parts.append(f"folded twice {_runs(repeated)}")
    if extra:
        parts.append(f"folded but dropped by the model {_runs(extra)}")
    if not (missing or repeated or extra):
        parts.append("same tickets, other order or content" if seen != want["indices"] else "other content")
    if ranks is not None:
        parts.append(ranks)
    return f"{node}: " + "; ".join(parts)


def names_the_culprit(stderr: str, nodes: list[str]) -> bool:
    """A failure message is clear when it names a node of the graph or a ticket."""
    if any(f"'{n}'" in stderr or f"`{n}`" in stderr or f"node {n}" in stderr for n in nodes):
        return True
    return re.search(r"\bt-\d{6}\b|ticket", stderr) is not None
