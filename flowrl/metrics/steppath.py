"""Where a synchronous step's wall time goes: its critical path, call by call, from trace.json.

With `max_staleness: 0` the rollout waits for the weights of the update its last batch fed, so a
step is one chain: the subscriber's call (the rollout), the calls of ticket t down to the
publisher's (the trainer), the trainer's snapshot, the weight-sync round, and the subscriber's
next call. Every gap between two of them is the framework's: a batch handed to the next node
(channel, event loop, compute thread), the version announced (`published` -> controller -> `sync`
orders), the round itself (handshake in the store, the broadcast: from the publisher's start to
the end of the subscriber's receive) and the landing of the weights.

    path = step_path(load_trace(run_dir / "trace.json"))   # None: no synchronous step in the trace
    print("\\n".join(step_path_table(path)))

The chain of ticket t is built backwards from the trainer's call: each call's predecessor is the
call of ticket t that ended last before it started (with parallel branches, the one that gated
it). Means over the steps whose chain has the most common shape, from the second step on (a step
is the time from one subscriber call's start to the next's; the first forms the weight group):
each step's parts add up to it, so their means add up to the mean step, and a slow step shows in
the part that was slow (a median would hide it, and the medians of skewed parts would not add up).
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from flowrl.metrics.trace import track_names

SYNCHRONOUS_SHARE = 0.8  # at least this share of steps must wait for the round (k=0), else None
WARMUP_STEPS = 1
"""Steps left out at the start: the first round forms the weight group and the first snapshot
allocates (19 ms against 0.14 in a pipeline.py k=0 run), as the CPU table starts at step 2."""


@dataclass
class StepPath:
    steps: int                             # steps measured
    step_ms: float                         # mean step
    parts: list[tuple[str, str, float]]    # (label, "call" | "between", mean ms), in path order
    spread: list[tuple[float, float]]      # each part's (median, p90) ms, from the same steps

    def ms(self, kind: str) -> float:
        return sum(ms for _, k, ms in self.parts if k == kind)


PATH_SPANS = ("compute", "weight_snapshot", "weight_sync")  # the spans a step's path is made of


def _spans(events: list[dict[str, Any]]) -> tuple[dict, dict]:
    """(node -> span name -> [(start_ms, end_ms)] in time order, node -> batch id -> its first
    `compute` span), for PATH_SPANS only; a node's replicas together (a track is "node/replica")."""
    names = track_names(events)
    spans: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    calls: dict[str, dict[str, tuple[float, float]]] = defaultdict(dict)
    for e in events:
        if e.get("ph") != "X" or e.get("name") not in PATH_SPANS or e.get("pid") not in names:
            continue
        node, t0 = names[e["pid"]].rpartition("/")[0] or names[e["pid"]], e["ts"] / 1e3
        span = (t0, t0 + e.get("dur", 0) / 1e3)
        spans[node][e["name"]].append(span)
        bid = (e.get("args") or {}).get("batch_id")
        if e["name"] == "compute" and bid is not None and (bid not in calls[node] or span < calls[node][bid]):
            calls[node][bid] = span
    for named in spans.values():
        for v in named.values():
            v.sort()
    return spans, calls


def _first_after(spans: list[tuple[float, float]], t: float, before: float) -> tuple[float, float] | None:
    """The first span (in time order) that starts in [t, before)."""
    i = bisect.bisect_left(spans, (t, float("-inf")))
    return spans[i] if i < len(spans) and spans[i][0] < before else None


def _chain(calls: dict, bid: str, pub: str, sub: str, first: float) -> list[tuple[str, tuple]] | None:
    """Ticket `bid`'s calls from the subscriber's (which started at `first`) to the publisher's, in
    order, found backwards: each call's predecessor is the call of the ticket that ended last before
    it started. None when the chain does not reach the subscriber."""
    chain = [(pub, calls[pub][bid])]
    while chain[-1][0] != sub:
        start, seen = chain[-1][1][0], {n for n, _ in chain}
        before = [(c[bid][1], n, c[bid]) for n, c in calls.items()
                  if bid in c and n not in seen and first <= c[bid][0] and c[bid][1] <= start]
        if not before:
            return None
        _, n, span = max(before)
        chain.append((n, span))
    return chain[::-1]


def _step_parts(spans: dict, chain: list, pub: str, sub: str, next_call: float) -> list[tuple[str, str, float]] | None:
    """The step's parts in path order: each call and the gap before it, then what joins the
    publisher's call to the subscriber's next (at `next_call`); None without a snapshot and a round
    between them."""
    parts = []
    for (before, prev), (n, span) in zip([(None, None), *chain], chain):
        if before is not None:
            parts.append((f"{before} -> {n}", "between", span[0] - prev[1]))
        parts.append((f"{n} call", "call", span[1] - span[0]))
    end = chain[-1][1][1]
    snap = _first_after(spans[pub]["weight_snapshot"], end, next_call)
    rnd = _first_after(spans[pub].get("weight_sync", []), snap[1], next_call) if snap else None
    if rnd is None:
        return None
    # the round ends where the subscriber's receive does, its last before the next call (the
    # publisher's span closes a little later, often after the subscriber landed and called again)
    received = spans[sub]["weight_sync"]
    i = bisect.bisect_left(received, (next_call,))
    done = min(received[i - 1][1], next_call) if i and received[i - 1][1] >= rnd[0] else rnd[1]
    return [*parts, (f"{pub} call -> snapshot", "between", snap[0] - end),
            ("weight snapshot", "between", snap[1] - snap[0]),
            ("snapshot -> round (published, sync orders)", "between", rnd[0] - snap[1]),
            ("weight-sync round", "between", done - rnd[0]),
            (f"round -> next {sub} call (landing)", "between", next_call - done)]


def step_path(events: list[dict[str, Any]]) -> StepPath | None:
    """The mean critical path of a synchronous step, or None: no single publisher and subscriber
    of weights in the trace, or steps that do not wait for the round (max_staleness >= 1)."""
    spans, calls = _spans(events)
    pubs = [n for n, s in spans.items() if s.get("weight_snapshot")]
    subs = [n for n, s in spans.items() if s.get("weight_sync") and n not in pubs and calls.get(n)]
    if len(pubs) != 1 or not subs:
        return None
    pub = pubs[0]
    sub = min(subs, key=lambda n: statistics.median(c[0] for c in calls[n].values()))  # the first on the path
    tickets = sorted((s, b) for b, s in calls[sub].items() if b in calls[pub])
    measured: dict[tuple, list[list[float]]] = defaultdict(list)  # path shape -> each step's parts and length
    synchronous = 0
    steady = tickets[WARMUP_STEPS:]
    for (s_t, bid), (s_next, _) in zip(steady, steady[1:]):
        if s_next[0] < calls[pub][bid][1]:  # the next call did not wait for this update: not synchronous
            continue
        synchronous += 1
        chain = _chain(calls, bid, pub, sub, s_t[0])
        parts = _step_parts(spans, chain, pub, sub, s_next[0]) if chain else None
        if parts is not None:
            measured[tuple((label, kind) for label, kind, _ in parts)].append(
                [*(ms for _, _, ms in parts), s_next[0] - s_t[0]])
    if not measured or synchronous < SYNCHRONOUS_SHARE * (len(steady) - 1):
        return None
    shape, steps = max(measured.items(), key=lambda kv: len(kv[1]))
    columns = list(zip(*steps))
    return StepPath(steps=len(steps), step_ms=statistics.fmean(columns[-1]),
                    parts=[(label, kind, statistics.fmean(col)) for (label, kind), col in zip(shape, columns)],
                    spread=[(statistics.median(col), _p90(col)) for col in columns[:-1]])


def _p90(values) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[-1] if len(values) > 1 else values[0]


def step_path_table(path: StepPath) -> list[str]:
    """The path as lines: each call and each gap with its mean ms, its share of the mean step and,
    from the same steps, its median and p90 (a part that is slow now and then, such as a round that
    waits on a busy core, shows as a p90 well above its median)."""
    width = max(len(label) for label, _, _ in path.parts)
    out = [f"a synchronous step's critical path (max_staleness 0), means over {path.steps} steps: "
           f"{path.step_ms:.1f} ms a step"]
    for (label, kind, ms), (median, p90) in zip(path.parts, path.spread):
        name = ("  " if kind == "call" else "    ") + label
        out.append(f"{name:<{width + 6}} {ms:8.2f} ms {100 * ms / path.step_ms:5.1f}%"
                   f"   median {median:7.2f}  p90 {p90:7.2f}")
    calls, between = path.ms("call"), path.ms("between")
    out.append(f"  calls {calls:.1f} ms ({100 * calls / path.step_ms:.1f}%), between calls (the framework's) "
               f"{between:.1f} ms ({100 * between / path.step_ms:.1f}%)")
    return out
