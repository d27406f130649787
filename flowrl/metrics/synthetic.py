"""A realistic run directory without running anything: for tests, docs and `flowrl report` demos.

    python -m flowrl.metrics.synthetic /tmp/demo rollout_bound && flowrl report /tmp/demo

It simulates the PPO pipeline rollout -> reward -> actor (weight sync back to rollout) with
`max_staleness` on a virtual clock and drives the *real* Recorder and MetricsHub with it, so the
files (metrics.jsonl, trace.json, status.json) are exactly what the runtime writes — only the
timing is invented. The scenarios have a known bottleneck:

    rollout_bound   1 rollout replica, 0.9 s per batch; the actor (0.3 s) waits for input
    actor_bound     2 rollout replicas, 0.4 s per batch; the actor (0.9 s) is saturated and
                    rollout waits for credit
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path

from flowrl.metrics.hub import MetricsHub
from flowrl.metrics.recorder import Recorder
from flowrl.metrics.status import write_status


@dataclass(frozen=True)
class Scenario:
    rollout_replicas: int
    gen_s: float  # seconds per batch in one rollout replica
    reward_s: float
    train_s: float
    sync_s: float
    max_staleness: int = 1
    batch: int = 64  # samples per batch
    prompt_tokens: int = 48
    response_tokens: int = 64
    devices: int = 3


SCENARIOS = {
    "rollout_bound": Scenario(rollout_replicas=1, gen_s=0.9, reward_s=0.05, train_s=0.3, sync_s=0.05),
    "actor_bound": Scenario(rollout_replicas=2, gen_s=0.4, reward_s=0.05, train_s=0.9, sync_s=0.1,
                            devices=4),
}


class VirtualClock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def write_synthetic_run(run_dir: str | Path, scenario: str = "rollout_bound", steps: int = 40,
                        seed: int = 0) -> Path:
    """Write RUN_DIR/{metrics.jsonl, trace.json, status.json} for `scenario`; returns run_dir."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; choose one of {sorted(SCENARIOS)}")
    sc, rng = SCENARIOS[scenario], random.Random(seed)
    run_dir = Path(run_dir)
    clock = VirtualClock(1_700_000_000.0)
    start = clock.t + 2.0  # model loading before the first batch
    hub = MetricsHub(run_dir, devices=sc.devices, clock=clock)
    recs = {("rollout", r): Recorder("rollout", r, clock=clock) for r in range(sc.rollout_replicas)}
    recs[("reward", 0)] = Recorder("reward", 0, clock=clock)
    recs[("actor", 0)] = Recorder("actor", 0, clock=clock)
    events: list[tuple[float, int, tuple[str, int], str, tuple, dict]] = []

    def emit(t: float, who: tuple[str, int], what: str, *args: object, **kw: object) -> None:
        events.append((t, len(events), who, what, args, kw))

    def span(who: tuple[str, int], name: str, a: float, b: float, **kw: object) -> None:
        if b - a > 1e-6:
            emit(b, who, "add_span", name, a, b - a, **kw)

    roll_free = [start] * sc.rollout_replicas
    reward_free = actor_free = start
    sync_done = [start]  # sync_done[v]: when weights of version v reached the rollout replicas
    gen_end, rw_start, step_end = [], [], []
    for i in range(steps):
        r, need = i % sc.rollout_replicas, max(0, i - sc.max_staleness)
        ready = max(roll_free[r], sync_done[need]) if need < len(sync_done) else None
        assert ready is not None, "the staleness bound always refers to a finished update"
        used = max(v for v, t in enumerate(sync_done) if t <= ready)
        span(("rollout", r), "wait_credit", roll_free[r], ready)
        g0, g1 = ready, ready + sc.gen_s * rng.uniform(0.9, 1.1)
        span(("rollout", r), "compute", g0, g1, batch_id=f"t{i}", policy_version=used)
        roll_free[r] = g1
        gen_end.append(g1)
        tokens = sc.batch * (sc.prompt_tokens + int(sc.response_tokens * rng.uniform(0.8, 1.2)))
        emit(g1, ("rollout", r), "count", "samples", sc.batch)
        emit(g1, ("rollout", r), "count", "tokens", tokens)
        emit(g1, ("rollout", r), "count", "channel_bytes", tokens * 4, edge="rollout->reward")
        emit(g1, ("rollout", r), "count", "channel_messages", 1, edge="rollout->reward")
        for _ in range(8):
            emit(g1, ("rollout", r), "observe", "rollout_latency_s", (g1 - g0) * rng.uniform(0.5, 1.0))
        w0 = max(g1, reward_free)
        rw_start.append(w0)
        span(("reward", 0), "wait_input", reward_free, w0)
        w1 = w0 + sc.reward_s * rng.uniform(0.8, 1.2)
        span(("reward", 0), "compute", w0, w1, batch_id=f"t{i}")
        reward_free = w1
        progress = i / max(1, steps - 1)
        emit(w1, ("reward", 0), "mean", "reward", 0.1 + 0.7 * progress ** 0.7 + rng.gauss(0, 0.04),
             weight=sc.batch)
        emit(w1, ("reward", 0), "count", "channel_bytes", tokens * 4 + 256, edge="reward->actor")
        emit(w1, ("reward", 0), "count", "channel_messages", 1, edge="reward->actor")
        a0 = max(w1, actor_free)
        span(("actor", 0), "wait_input", actor_free, a0)
        a1 = a0 + sc.train_s * rng.uniform(0.95, 1.05)
        span(("actor", 0), "compute", a0, a1, batch_id=f"t{i}")
        s1 = a1 + sc.sync_s
        span(("actor", 0), "weight_sync", a1, s1, version=i + 1)
        emit(a1, ("actor", 0), "observe", "staleness", i - used)
        emit(a1, ("actor", 0), "max", "staleness", i - used)
        emit(a1, ("actor", 0), "mean", "policy_loss", 0.5 * (1 - progress) + rng.gauss(0, 0.03))
        emit(a1, ("actor", 0), "mean", "kl", 0.01 + 0.02 * progress)
        emit(s1, ("actor", 0), "count", "weight_sync_bytes", 2 * 25_000_000)
        emit(s1, ("actor", 0), "observe", "weight_sync_s", sc.sync_s)
        actor_free = s1
        sync_done.append(s1)
        step_end.append(s1)

    events.sort(key=lambda e: (e[0], e[1]))
    k = 0
    for step, t_end in enumerate(step_end, start=1):
        while k < len(events) and events[k][0] <= t_end:
            t, _, who, what, args, kw = events[k]
            clock.t = t
            getattr(recs[who], what)(*args, **kw)
            k += 1
        clock.t = t_end
        for (node, replica), rec in recs.items():
            busy = 0.9 if node == "rollout" and "rollout" in scenario else 0.5
            rec.gauge("cpu_percent", 100 * busy * rng.uniform(0.9, 1.0), per_node=True)
            rec.gauge("rss_bytes", (900 + 10 * step) * 2**20, per_node=True)
            hub.ingest(rec.drain())
        hub.set("queue_depth", sum(1 for g, w in zip(gen_end, rw_start) if g <= t_end < w),
                edge="rollout->reward")
        hub.set("queue_depth", 0, edge="reward->actor")
        for node in ("rollout", "reward", "actor"):
            hub.set("node_up", 1, node=node, across="min")
        hub.end_step(step=step, policy_version=step)
    write_status(run_dir, hub.live_state(), phase="finished",
                 graph={"name": f"synthetic-{scenario}", "total_steps": steps,
                        "nodes": {"rollout": sc.rollout_replicas, "reward": 1, "actor": 1},
                        "edges": ["rollout->reward", "reward->actor"], "devices": sc.devices})
    hub.close()
    return run_dir


if __name__ == "__main__":
    write_synthetic_run(sys.argv[1], *(sys.argv[2:3] or ["rollout_bound"]))
    print(f"wrote {sys.argv[1]}")
