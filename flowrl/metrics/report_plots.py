"""The report's pictures, one figure per question a person asks of a run:

    reward.png      is it learning?               reward_mean per step + rolling mean
    throughput.png  how fast?                     tokens/s per device (verl) and step time
    timeline.png    who waits for whom?           per node process: compute / sync / waits, and
                                                  each node's busy share over time
    staleness.png   how off-policy?               staleness per step and its distribution
    losses.png      is the optimiser sane?        every *loss* column (when there is one)

Figures are built with matplotlib's object API on an Agg canvas (`Figure` + `FigureCanvasAgg`),
so nothing touches pyplot's global state and no display is needed.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from flowrl.metrics.trace import track_names

COLORS = {"compute": "#2b8a3e", "weight_sync": "#7048e8", "wait_input": "#f59f00",
          "wait_credit": "#e03131"}
OTHER = "#868e96"
LINES = ["#1c7ed6", "#ae3ec9", "#495057", "#15aabf", "#f06595", "#845ef7", "#795548"]


def _figure(w: float, h: float, rows: int = 1, cols: int = 1, **kw: Any) -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(rows, cols, squeeze=False, **kw)


def _xy(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], r[key]) for r in rows
           if isinstance(r.get(key), (int, float)) and isinstance(r.get("step"), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _rolling(ys: list[float], k: int) -> list[float]:
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y - (ys[i - k] if i >= k else 0.0)
        out.append(acc / min(i + 1, k))
    return out


def _style(ax: Any, xlabel: str, ylabel: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.spines[["top", "right"]].set_visible(False)


def plot_reward(path: Path, rows: list[dict[str, Any]]) -> bool:
    xs, ys = _xy(rows, "reward_mean")
    if not ys:
        return False
    fig, ax = _figure(8, 4.5)
    ax = ax[0][0]
    k = max(1, len(ys) // 15)
    ax.plot(xs, ys, ".", color="#74c0fc", label="reward_mean per step")
    ax.plot(xs, _rolling(ys, k), color="#1864ab", lw=2.2, label=f"rolling mean ({k} steps)")
    _style(ax, "training step", "reward (mean per sample)")
    ax.set_title(f"Reward: {ys[0]:.3f} at step {xs[0]} -> {ys[-1]:.3f} at step {xs[-1]}")
    ax.legend(loc="lower right")
    fig.savefig(path)
    return True


def plot_throughput(path: Path, rows: list[dict[str, Any]]) -> bool:
    xs, tpd = _xy(rows, "tokens_per_s_per_device")
    if not tpd:
        return False
    fig, (a, b) = _figure(8, 6, 2, 1, sharex=True)
    a, b = a[0], b[0]
    k = max(1, len(tpd) // 15)
    a.plot(xs, tpd, color="#a5d8ff", lw=1)
    a.plot(xs, _rolling(tpd, k), color="#1864ab", lw=2.2, label=f"rolling mean ({k} steps)")
    devices = next((r["devices"] for r in reversed(rows) if r.get("devices")), None)
    _style(a, "", "tokens / s / device" + (f" ({devices} devices)" if devices else ""))
    a.set_title("Throughput: (prompt + response) tokens / (step time x devices), as verl counts")
    a.legend(loc="lower right")
    sx, st = _xy(rows, "step_time_s")
    b.plot(sx, st, color="#e8590c", lw=1.5)
    _style(b, "training step", "step time (s)")
    fig.savefig(path)
    return True


def _tracks(events: list[dict[str, Any]]) -> tuple[list[tuple[int, str]], dict[int, list]]:
    names = track_names(events)
    spans: dict[int, list] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and names.get(e.get("pid"), "controller") != "controller":
            spans[e["pid"]].append(e)
    # pipeline order ~ order of first appearance; replicas of one node stay together
    first: dict[str, int] = {}
    for p in sorted(spans):
        first.setdefault(names[p].rpartition("/")[0], p)
    order = sorted(spans, key=lambda p: (first[names[p].rpartition("/")[0]], names[p], p))
    return [(p, names[p]) for p in order], spans


def plot_timeline(path: Path, events: list[dict[str, Any]]) -> bool:
    from matplotlib.patches import Patch

    tracks, spans = _tracks(events)
    if not tracks:
        return False
    all_spans = [e for p, _ in tracks for e in spans[p]]
    t0 = min(e["ts"] for e in all_spans)
    t1 = max(e["ts"] + e.get("dur", 0) for e in all_spans)
    fig, (g, u) = _figure(11, 2.6 + 0.5 * len(tracks) + 2.6, 2, 1, sharex=True,
                          height_ratios=[max(1.5, 0.5 * len(tracks)), 2.2])
    g, u = g[0], u[0]
    labels = []
    for row, (pid, name) in enumerate(tracks):
        by_kind: dict[str, list] = defaultdict(list)
        busy = 0.0
        for e in spans[pid]:
            by_kind[e["name"]].append(((e["ts"] - t0) / 1e6, e.get("dur", 0) / 1e6))
            busy += e.get("dur", 0) / 1e6 if e["name"] in ("compute", "weight_sync") else 0.0
        for kind, segs in by_kind.items():
            waiting = kind.startswith("wait")
            g.broken_barh(segs, (row - (0.25 if waiting else 0.4), 0.5 if waiting else 0.8),
                          facecolors=COLORS.get(kind, OTHER), alpha=0.55 if waiting else 0.95,
                          linewidth=0)
        labels.append(f"{name}  busy {100 * busy / max(1e-9, (t1 - t0) / 1e6):.0f}%")
    g.set_yticks(range(len(tracks)), labels)
    g.set_ylim(len(tracks) - 0.5, -0.5)
    g.set_title("Who works and who waits: one row per node process (blank = untracked)")
    g.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()], loc="upper center",
             bbox_to_anchor=(0.5, -0.04), ncol=4, frameon=False)
    g.spines[["top", "right"]].set_visible(False)
    # busy share per node (replicas averaged) in a sliding window of 1/20 of the run: wide enough
    # to average over a few pipeline cycles, so the curve shows trends, not every batch
    import numpy as np

    nodes: dict[str, list] = defaultdict(list)
    for pid, name in tracks:
        nodes[name.rpartition("/")[0] or name].append(pid)
    total = (t1 - t0) / 1e6
    half = total / 40
    xs = np.linspace(0.0, total, 160)
    for i, (node, pids) in enumerate(nodes.items()):
        busy_spans = [((e["ts"] - t0) / 1e6, e.get("dur", 0) / 1e6) for p in pids for e in spans[p]
                      if e["name"] in ("compute", "weight_sync")]
        if busy_spans:
            a, d = np.array(busy_spans).T
            done = lambda t: np.clip(t[:, None] - a[None, :], 0, d[None, :]).sum(axis=1)  # noqa: E731
            lo, hi = np.clip(xs - half, 0, total), np.clip(xs + half, 0, total)
            share = (done(hi) - done(lo)) / np.maximum(hi - lo, 1e-9) / len(pids)
        else:
            share = np.zeros_like(xs)
        u.plot(xs, 100 * share, lw=2, color=LINES[i % len(LINES)], label=node)
    _style(u, "seconds since the first span", "busy % (sliding window)")
    u.set_ylim(0, 105)
    u.legend(loc="best", ncol=min(4, len(nodes)))
    fig.savefig(path)
    return True


def plot_staleness(path: Path, rows: list[dict[str, Any]]) -> bool:
    xs, ys = _xy(rows, "staleness_max")
    if not ys:
        return False
    fig, axs = _figure(10, 4, 1, 2, width_ratios=[2, 1])
    a, b = axs[0]
    a.step(xs, ys, where="mid", color="#c2255c", lw=1.8, label="max per step")
    mx, my = _xy(rows, "staleness_mean")
    if my:
        a.plot(mx, my, color="#f783ac", lw=1.2, label="mean per step")
    from matplotlib.ticker import MaxNLocator

    _style(a, "training step", "staleness (policy versions)")
    a.yaxis.set_major_locator(MaxNLocator(integer=True))
    a.set_ylim(-0.3, max(ys) + 0.8)
    a.set_title("Staleness: how many updates old the samples were")
    a.legend(loc="upper left", ncol=2)
    counts: dict[int, int] = defaultdict(int)
    for y in ys:
        counts[int(round(y))] += 1
    b.bar(list(counts), list(counts.values()), color="#c2255c", width=0.6)
    _style(b, "max staleness in a step", "steps")
    b.set_xticks(sorted(counts))
    fig.savefig(path)
    return True


def plot_losses(path: Path, rows: list[dict[str, Any]]) -> bool:
    keys = sorted({k for r in rows for k in r if "loss" in k and isinstance(r[k], (int, float))})
    if not keys:
        return False
    fig, ax = _figure(8, 4.5)
    ax = ax[0][0]
    for k in keys[:8]:
        xs, ys = _xy(rows, k)
        ax.plot(xs, ys, lw=1.6, label=k)
    _style(ax, "training step", "loss")
    ax.set_title("Losses")
    ax.legend(loc="upper right")
    fig.savefig(path)
    return True


def write_plots(out: Path, rows: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[Path]:
    written = []
    for name, fn, data in (("reward", plot_reward, rows), ("throughput", plot_throughput, rows),
                           ("timeline", plot_timeline, events), ("staleness", plot_staleness, rows),
                           ("losses", plot_losses, rows)):
        path = out / f"{name}.png"
        if fn(path, data):
            written.append(path)
    return written
