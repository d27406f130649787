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

from flowrl.metrics.recorder import BUSY_SPANS as BUSY
from flowrl.metrics.trace import track_names

COLORS = {"compute": "#2b8a3e", "weight_sync": "#7048e8", "weight_snapshot": "#b197fc",
          "wait_credit": "#e03131", "wait_input": "#f59f00"}

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
    """Centred rolling mean over k points (fewer at the ends): unlike a trailing mean it does not
    lag the points it summarises, so a rising reward is drawn where it rose."""
    acc = [0.0]
    for y in ys:
        acc.append(acc[-1] + y)
    lo_off, hi_off = (k - 1) // 2, k // 2
    out = []
    for i in range(len(ys)):
        lo, hi = max(0, i - lo_off), min(len(ys), i + hi_off + 1)
        out.append((acc[hi] - acc[lo]) / (hi - lo))
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


def _startup_outlier(ys: list[float]) -> bool:
    """The first step also holds process start-up and model loading: leave it off the scale
    when it is far above the rest, or every later step is a flat line at the bottom."""
    if len(ys) < 4:
        return False
    rest = sorted(ys[1:])
    return ys[0] > 3 * rest[len(rest) // 2] and ys[0] > 1.5 * rest[-1]


def plot_throughput(path: Path, rows: list[dict[str, Any]]) -> bool:
    xs, tpd = _xy(rows, "tokens_per_s_per_device")
    if not tpd:
        return False
    fig, (a, b) = _figure(8, 6, 2, 1, sharex=True)
    a, b = a[0], b[0]
    sx, st = _xy(rows, "step_time_s")
    skip = 1 if _startup_outlier(st) and sx[:1] == xs[:1] else 0
    k = max(1, len(tpd) // 15)
    a.plot(xs[skip:], tpd[skip:], color="#a5d8ff", lw=1, label="per step")
    a.plot(xs[skip:], _rolling(tpd[skip:], k), color="#1864ab", lw=2.2,
           label=f"rolling mean ({k} steps)")
    devices = next((r["devices"] for r in reversed(rows) if r.get("devices")), None)
    _style(a, "", "tokens / s / device" + (f" ({devices} devices)" if devices else ""))
    a.set_ylim(bottom=0)
    a.set_title("Throughput: (prompt + response) tokens / (step time x devices), as verl counts")
    a.legend(loc="lower right")
    b.plot(sx[skip:], st[skip:], color="#e8590c", lw=1.5)
    _style(b, "training step", "step time (s)")
    b.set_ylim(bottom=0)
    if skip:
        note = f"step {sx[0]} took {st[0]:.1f} s (start-up, model loading): left off the plots"
        b.set_title(note, loc="right", fontsize=8, color="#495057")
    fig.savefig(path)
    return True


def _tracks(events: list[dict[str, Any]], order: list[str] | None = None
            ) -> tuple[list[tuple[int, str]], dict[int, list]]:
    """Node processes in graph order (replicas of a node together), with their exclusive state
    segments; nodes the graph does not list follow in order of first appearance."""
    from flowrl.metrics.analysis import process_segments

    names = track_names(events)
    segments = {p: s for p, s in process_segments(events).items() if s}
    first: dict[str, int] = {}
    for p in sorted(segments):
        first.setdefault(names[p].rpartition("/")[0] or names[p], p)
    rank = {n: i for i, n in enumerate(order or [])}
    key = lambda p: (rank.get(names[p].rpartition("/")[0], len(rank)),  # noqa: E731
                     first[names[p].rpartition("/")[0] or names[p]], names[p], p)
    return [(p, names[p]) for p in sorted(segments, key=key)], segments


STATE_LABELS = {"compute": "compute", "weight_sync": "weight sync", "weight_snapshot": "weight snapshot",
                "wait_credit": "blocked (waits for credit)", "wait_input": "starved (waits for input)"}


def _cumulative(segs: list[tuple[float, float]]) -> tuple[Any, Any]:
    """Breakpoints of t -> seconds spent in `segs` (non-overlapping (start, end)) up to t."""
    import numpy as np

    if not segs:
        return np.array([0.0]), np.array([0.0])
    segs = sorted(segs)
    x = np.array([t for a, b in segs for t in (a, b)])
    y = np.concatenate([[0.0], np.cumsum([t for a, b in segs for t in (0.0, b - a)])[1:]])
    return x, y


def plot_timeline(path: Path, events: list[dict[str, Any]], order: list[str] | None = None) -> bool:
    import numpy as np
    from matplotlib.patches import Patch

    tracks, segments = _tracks(events, order)
    if not tracks:
        return False
    t0 = min(segments[p][0][0] for p, _ in tracks)
    t1 = max(segments[p][-1][1] for p, _ in tracks)
    total = max(1e-6, (t1 - t0) / 1e6)
    nodes: dict[str, list[int]] = defaultdict(list)
    for pid, name in tracks:
        nodes[name.rpartition("/")[0] or name].append(pid)
    n_t, n_n = len(tracks), len(nodes)
    fig, axes = _figure(11, 1.4 + 0.42 * n_t + 0.62 * n_n + 0.9, 1 + n_n, 1, sharex=True,
                        height_ratios=[max(1.4, 0.42 * n_t)] + [0.62] * n_n)
    g = axes[0][0]
    # at least one pixel wide: a 1 ms compute span in a 60 s run must still be visible
    min_w = total / 1400
    labels = []
    for row, (pid, name) in enumerate(tracks):
        by_state: dict[str, list] = defaultdict(list)
        busy = 0.0
        for a, b, state in segments[pid]:
            start, dur = (a - t0) / 1e6, (b - a) / 1e6
            if state in BUSY:
                busy += dur
                dur = max(dur, min_w)
            by_state[state].append((start, dur))
        for state, segs in by_state.items():
            waiting = state.startswith("wait")
            g.broken_barh(segs, (row - (0.22 if waiting else 0.38), 0.44 if waiting else 0.76),
                          facecolors=COLORS.get(state, OTHER), alpha=0.6 if waiting else 1.0,
                          linewidth=0)
        labels.append(f"{name}  busy {100 * busy / total:.0f}%")
    g.set_yticks(range(n_t), labels)
    g.set_ylim(n_t - 0.5, -0.5)
    fig.suptitle("Who works and who waits: one row per node process (blank = untracked)")
    shown = [s for s in COLORS if any(st == s for p, _ in tracks for _, _, st in segments[p])]
    g.legend(handles=[Patch(color=COLORS[k], label=STATE_LABELS.get(k, k)) for k in shown],
             loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(shown), frameon=False,
             fontsize=8.5)
    g.spines[["top", "right"]].set_visible(False)
    # below: each node's share of time per state in a sliding window of ~1/30 of the run, wide
    # enough to average over pipeline cycles, so long runs show trends rather than every batch
    xs = np.linspace(0.0, total, 240)
    half = max(total / 60, min_w)
    lo, hi = np.clip(xs - half, 0, total), np.clip(xs + half, 0, total)
    width = np.maximum(hi - lo, 1e-9)
    stack = [(("compute",), COLORS["compute"]), (("weight_sync", "weight_snapshot"), COLORS["weight_sync"]),
             (("wait_credit",), COLORS["wait_credit"]), (("wait_input",), COLORS["wait_input"])]
    for i, (node, pids) in enumerate(nodes.items()):
        ax = axes[1 + i][0]
        base = np.zeros_like(xs)
        mean_busy = 0.0
        for states, color in stack:
            share = np.zeros_like(xs)
            for pid in pids:
                segs = [((a - t0) / 1e6, (b - t0) / 1e6) for a, b, st in segments[pid] if st in states]
                x, y = _cumulative(segs)
                share += (np.interp(hi, x, y) - np.interp(lo, x, y)) / width
            share = np.clip(100 * share / len(pids), 0, 100 - base)
            waiting = states[0].startswith("wait")
            ax.fill_between(xs, base, base + share, color=color, alpha=0.6 if waiting else 1.0,
                            linewidth=0)
            base = base + share
        mean_busy = float(sum(b - a for p in pids for a, b, st in segments[p] if st in BUSY)
                          / 1e6 / total / len(pids))
        ax.set_ylim(0, 100)
        ax.set_yticks([0, 100], ["", "100%"], fontsize=7)
        reps = f" x{len(pids)}" if len(pids) > 1 else ""
        ax.set_ylabel(f"{node}{reps}\n{100 * mean_busy:.0f}% busy", rotation=0, ha="right",
                      va="center", fontsize=8.5)
        ax.grid(True, axis="x", alpha=0.3)
        ax.spines[["top", "right"]].set_visible(False)
        if i == 0:
            ax.set_title(f"Share of time per node (sliding {2 * half:.2g} s window): work below, "
                         f"waits stacked on top", fontsize=10)
    axes[-1][0].set_xlabel("seconds since the first span")
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
    top = max(1, int(max(ys)))
    _style(a, "training step", "staleness (policy versions)")
    a.set_yticks(range(0, top + 1, max(1, (top + 1) // 8)))
    a.set_ylim(-0.3, top + 0.8)
    on_policy = max(ys) == 0
    a.set_title("Staleness: how many updates old the samples were"
                + (" (all on-policy)" if on_policy else ""))
    a.legend(loc="upper left", ncol=2)
    counts: dict[int, int] = defaultdict(int)
    for y in ys:
        counts[int(round(y))] += 1
    b.bar(list(counts), list(counts.values()), color="#c2255c", width=0.6)
    _style(b, "max staleness in a step", "steps")
    b.set_xticks(sorted(counts))
    b.set_xlim(min(counts) - 0.8, max(counts) + 0.8)
    fig.savefig(path)
    return True


def plot_losses(path: Path, rows: list[dict[str, Any]]) -> bool:
    keys = sorted({k for r in rows for k in r if "loss" in k and isinstance(r[k], (int, float))})
    if not keys:
        return False
    keys = keys[:6]
    fig, axs = _figure(8, 1.2 + 2.0 * len(keys), len(keys), 1, sharex=True)
    for i, k in enumerate(keys):
        ax = axs[i][0]
        xs, ys = _xy(rows, k)
        color = LINES[i % len(LINES)]
        n = max(1, len(ys) // 15)
        if n == 1:
            ax.plot(xs, ys, lw=1.6, color=color, marker=".", label=k)
        else:
            ax.plot(xs, ys, lw=1, color=color, alpha=0.35)
            ax.plot(xs, _rolling(ys, n), lw=2, color=color, label=f"{k} (rolling mean, {n} steps)")
        if min(ys, default=0) < 0 < max(ys, default=0):
            ax.axhline(0, color="#adb5bd", lw=0.8)
        _style(ax, "training step" if i == len(keys) - 1 else "", "")
        ax.legend(loc="upper right", fontsize=8.5, frameon=False)
    axs[0][0].set_title("Losses per step (each on its own scale)")
    fig.savefig(path)
    return True


def write_plots(out: Path, rows: list[dict[str, Any]], events: list[dict[str, Any]],
                order: list[str] | None = None) -> list[Path]:
    """Every plot there is data for; `order` = the graph's node order for the timeline."""
    written = []
    for name, fn, data in (("reward", plot_reward, rows), ("throughput", plot_throughput, rows),
                           ("timeline", lambda p, e: plot_timeline(p, e, order), events),
                           ("staleness", plot_staleness, rows), ("losses", plot_losses, rows)):
        path = out / f"{name}.png"
        if fn(path, data):
            written.append(path)
    return written
