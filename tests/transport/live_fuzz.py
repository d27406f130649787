"""Live-channel fuzz: a flowrl Receiver in its own process, fed by a legitimate producer (a known
sequence of batches, at a steady pace) while `flowrl.transport.hostile` throws hostile traffic at
the same socket. Shared by tests/transport/test_live_fuzz.py and benchmarks/fuzz_channels.py.

What it measures: the consumer survives (ends with end-of-stream, not a crash), every legitimate
batch arrives exactly once and in order, how many of them arrived while the attack ran (the
legitimate stream is served during it, not only after), the longest gap between two legitimate
batches (a stall), the consumer's resident memory before and after, and its rejection counters.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PEER = str(Path(__file__).with_name("peer.py"))


def _reader(name: str, proc: subprocess.Popen, out: queue.Queue) -> None:
    for line in proc.stdout:
        try:
            out.put((name, json.loads(line)))
        except ValueError:
            continue
    out.put((name, {"event": "eof"}))


def fuzz(count: int = 20_000, batches: int = 3000, interval: float = 0.003, seed: int = 0, bursts: int = 2,
         timeout: float = 120.0) -> dict:
    """Run one fuzz; returns the measurements (see the module docstring)."""
    secret = secrets.token_bytes(32)
    tmp = tempfile.mkdtemp(prefix="flowrl-fuzz-")
    address = f"ipc://{tmp}/rx"
    link_bytes = 1 << 20
    common = ["--secret-hex", secret.hex(), "--capacity", "16", "--capacity-bytes", str(4 << 20),
              "--link-messages", "8", "--link-bytes", str(link_bytes), "--max-message-bytes", str(link_bytes),
              "--credit-idle", "0.5", "--peer-timeout", "2.0", "--name", "fuzz"]
    events: queue.Queue = queue.Queue()
    procs: dict[str, subprocess.Popen] = {}

    def start(name: str, *args: str) -> None:
        procs[name] = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, text=True)
        threading.Thread(target=_reader, args=(name, procs[name], events), daemon=True).start()

    def wait(name: str, kind: str, deadline: float) -> dict:
        for ev in seen[name]:  # it may have come while we waited for another process
            if ev["event"] in (kind, "error"):
                return ev
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                got = [e for e in seen["consumer"] if e["event"] == "recv"]
                raise TimeoutError(f"{name}: no {kind!r} event in time; the consumer received {len(got)} batches, "
                                   f"the last {got[-1] if got else None}")
            who, ev = events.get(timeout=left)
            seen[who].append(ev)
            if who == name and ev["event"] in (kind, "eof", "error"):
                return ev

    seen: dict[str, list[dict]] = {"consumer": [], "producer": [], "attacker": []}
    deadline = time.monotonic() + timeout
    try:
        start("consumer", PEER, "consumer", address, *common)
        ready = wait("consumer", "ready", deadline)
        start("producer", PEER, "producer", address, "--count", str(batches), "--interval", str(interval),
              "--quiet", *common)
        wait("producer", "ready", deadline)
        t_attack = time.monotonic()
        start("attacker", "-m", "flowrl.transport.hostile", address, "--count", str(count), "--secret-hex",
              secret.hex(), "--seed", str(seed), "--link-bytes", str(link_bytes), "--bursts", str(bursts))
        attack = wait("attacker", "done", deadline)
        t_attack_end = time.monotonic()
        produced = wait("producer", "done", deadline)
        done = wait("consumer", "done", deadline)
    finally:
        for name, p in procs.items():
            if name == "consumer" and seen["consumer"] and seen["consumer"][-1]["event"] == "done":
                try:  # it finished: let it exit by itself (its exit code is part of the result)
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    recvs = [e for e in seen["consumer"] if e["event"] == "recv" and e["batch_id"].startswith("b")]
    ids = [e["batch_id"] for e in recvs]
    times = [e["t"] for e in recvs]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    attack_from = t_attack_end - attack.get("seconds", t_attack_end - t_attack)  # the attacker's own sending time
    return {
        "hostile_messages": attack.get("total", 0), "hostile_by_kind": attack.get("sent", {}),
        "abort_bursts": attack.get("sent", {}).get("abort_burst", 0) // 3000,
        "attack_s": round(t_attack_end - t_attack, 2),
        "consumer_exit": procs["consumer"].returncode, "consumer_event": done["event"],
        "legit_expected": batches, "legit_received": len(ids), "legit_unique": len(set(ids)),
        "legit_in_order": ids == [f"b{i}" for i in range(batches)],
        "legit_during_attack": sum(attack_from <= t <= t_attack_end for t in times),
        "max_gap_s": round(max(gaps, default=0.0), 3),
        "rss_before_mb": round(ready["rss"] / 2 ** 20, 1), "rss_after_mb": round(done.get("rss", 0) / 2 ** 20, 1),
        "stats": done.get("stats", {}), "producer_stats": produced.get("stats", {}),
    }


def table(r: dict) -> str:
    st = r["stats"]
    rows = [("hostile messages", r["hostile_messages"]), ("abort bursts (3,000 messages + disconnect)",
                                                          r["abort_bursts"]), ("attack duration s", r["attack_s"]),
            ("consumer crashes", 0 if r["consumer_event"] == "done" and r["consumer_exit"] == 0 else 1),
            ("legit batches sent / received / unique",
             f"{r['legit_expected']} / {r['legit_received']} / {r['legit_unique']}"),
            ("legit in order", r["legit_in_order"]), ("legit batches received during the attack", r["legit_during_attack"]),
            ("longest stall of the legit stream s", r["max_gap_s"]),
            ("consumer RSS before / after MB", f"{r['rss_before_mb']} / {r['rss_after_mb']}"),
            ("rejected", st.get("rejected")), ("challenged (hellos answered with a nonce)", st.get("challenged")),
            ("links reclaimed (sat on credit)", st.get("reclaimed")),
            ("answers to unknown links dropped (rate limit)", st.get("replies_dropped"))]
    w = max(len(k) for k, _ in rows)
    lines = [f"{k:<{w}}  {v}" for k, v in rows]
    lines.append("rejected by reason: " + ", ".join(f"{k} {v}" for k, v in sorted(st.get("rejected_by_reason",
                                                                                         {}).items())))
    lines.append("sent by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(r["hostile_by_kind"].items())))
    return "\n".join(lines)
