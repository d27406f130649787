"""What a batch costs a node process that only passes it on: a flowrl graph against raw pyzmq.

    python benchmarks/relay.py                  # table, ~1 min
    python benchmarks/relay.py --steps 400 --relays 3 --json out.json

The same chain both ways, one batch a step, paced like graphs/grpo.yaml's step (`--period`, 70 ms):
a source, `--relays` nodes that do nothing to the batch, a sink. Each process's CPU (all of its
threads: event loop, ZeroMQ I/O threads, compute thread, heartbeat) per batch:

- `flowrl`: a real run (`flowrl run`) of flowrl.testing.nodes' Numbers -> Scale x N -> Collect,
  the sink holding each batch for the period; CPU from the run's own accounting (`flowrl report`'s
  table). Per batch a relay receives it, acknowledges it, runs the node on its compute thread,
  encodes and sends the result, takes its consumer's acknowledgement, and reports metrics and
  spans to the controller.
- `raw pyzmq`: the least that a process per role costs: an asyncio process per stage with pyzmq
  sockets (zmq.asyncio), pinned to a core as flowrl's are. Per batch a relay receives it (a small
  header frame and the data frame), acknowledges it, sends it on, awaits its consumer's
  acknowledgement and sends one small message to a collector (the controller's place).

The gap between the two columns is the runtime's own per-batch work on the event loop: what
`flowrl report` calls framework time in a light process (docs/benchmarks.md, Where the cycles go).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue
import resource
import sys
import tempfile
import time
from pathlib import Path

from flowrl.metrics.breakdown import cpu_breakdown
from flowrl.metrics.report import load_rows
from flowrl.testing import run_graph

N = "flowrl.testing.nodes"
BATCH = 64  # int64s a batch: the source's `batch_size`
WARMUP = 5  # batches each raw process leaves out of its count (start-up)
TIMEOUT_S = 60.0  # a raw stage that hears nothing for this long fails the run


# ------------------------------------------------------------------------------------- flowrl
def flowrl_row(workdir: Path, steps: int, relays: int, period: float) -> dict[str, float]:
    names = [f"r{i}" for i in range(relays)]
    chain = ["numbers", *names, "collect"]
    nodes = "\n".join(f'  {n}: {{kind: "{N}:Scale", config: {{factor: 1}}}}' for n in names)
    text = f"""
name: relay
nodes:
  numbers: {{kind: "{N}:Numbers"}}
{nodes}
  collect: {{kind: "{N}:Collect", config: {{delay_s: {period}}}}}
edges: [{", ".join(f"{a} -> {b}" for a, b in zip(chain, chain[1:]))}]
schedule: {{steps: {steps}, batch_size: {BATCH}, max_staleness: 1}}
"""
    graph = workdir / "relay.yaml"
    graph.write_text(text)
    result = run_graph(graph, workdir / "relay", timeout_s=120 + 4 * steps * period)
    if result.exit_code != 0:
        raise SystemExit(f"the flowrl run failed:\n{result.stderr[-3000:]}")
    cpu = cpu_breakdown(load_rows(workdir / "relay" / "metrics.jsonl"))
    if cpu is None:
        raise SystemExit("the flowrl run has no CPU accounting in its metrics rows")
    per = {n: v["process_cpu_ms"] for n, v in cpu["nodes"].items()}
    return {"source": per["numbers"], "relay": sum(per[n] for n in names) / relays, "sink": per["collect"],
            "controller": per["controller"], "step_ms": cpu["step_wall_ms"]}


# ------------------------------------------------------------------------------------ raw pyzmq
def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return r.ru_utime + r.ru_stime


def _stage(role: str, inbox: str | None, outbox: str | None, collector: str, core: int, steps: int,
           period: float, results) -> None:
    import zmq
    import zmq.asyncio

    os.sched_setaffinity(0, {core % os.cpu_count()})
    ctx = zmq.asyncio.Context()
    rx = ctx.socket(zmq.ROUTER) if inbox else None
    tx = ctx.socket(zmq.DEALER) if outbox else None
    report = ctx.socket(zmq.DEALER)
    if rx is not None:
        rx.bind(inbox)
    if tx is not None:
        tx.connect(outbox)
    report.connect(collector)

    async def main() -> None:
        header = json.dumps({"batch_id": "", "tensors": {"x": ["int64", [BATCH]]}}).encode()
        data = bytes(8 * BATCH)
        start = None
        for i in range(steps):
            if i == WARMUP:
                start = _cpu_s()
            if rx is not None:
                ident, *frames = await asyncio.wait_for(rx.recv_multipart(copy=False), TIMEOUT_S)
                if tx is None:  # the sink holds the batch for a step, as a trainer would
                    await asyncio.sleep(period)
                await rx.send_multipart([ident, b"ack"])
            else:  # the source: paced by the acknowledgements, which the sink holds for a step
                frames = [header, data]
            if tx is not None:
                await tx.send_multipart(frames, copy=False)
                await asyncio.wait_for(tx.recv(), TIMEOUT_S)
            await report.send(b"m" * 200)
        results.put((role, (_cpu_s() - start) / (steps - WARMUP) * 1e3))

    try:
        asyncio.run(main())
    finally:
        ctx.destroy(linger=0)


def _collector(address: str, expect: int, results) -> None:
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(address)

    async def main() -> None:
        start = None
        for i in range(expect):
            await asyncio.wait_for(sock.recv_multipart(), TIMEOUT_S)
            if i == WARMUP * 4:
                start = _cpu_s()
        results.put(("controller", (_cpu_s() - start) / (expect - WARMUP * 4) * 1e3))

    try:
        asyncio.run(main())
    finally:
        ctx.destroy(linger=0)


def raw_row(steps: int, relays: int, period: float) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    d = tempfile.mkdtemp(prefix="flowrl-relay-")
    stages = ["source", *[f"relay{i}" for i in range(relays)], "sink"]
    box = {s: f"ipc://{d}/{s}" for s in stages}
    collector = f"ipc://{d}/collector"
    procs = [ctx.Process(target=_collector, args=(collector, steps * len(stages), results))]
    for i, s in enumerate(stages):
        inbox = box[s] if s != "source" else None
        outbox = box[stages[i + 1]] if s != "sink" else None
        procs.append(ctx.Process(target=_stage, args=(s, inbox, outbox, collector, i, steps, period, results)))
    here = str(Path(__file__).resolve().parent)  # spawned children import this module by name
    added = here not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        for p in procs:
            p.start()
        got: dict[str, float] = {}
        deadline = time.monotonic() + TIMEOUT_S + steps * period * 4
        while len(got) < len(procs):
            try:
                role, value = results.get(timeout=1.0)
                got[role] = value
            except queue.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    raise SystemExit(f"the raw chain failed (exit codes {failed}) or ran past its deadline")
    finally:
        if added:
            sys.path.remove(here)
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        for f in Path(d).iterdir():
            f.unlink()
        os.rmdir(d)
    relay = [v for k, v in got.items() if k.startswith("relay")]
    return {"source": got["source"], "relay": sum(relay) / len(relay), "sink": got["sink"],
            "controller": got["controller"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--relays", type=int, default=3)
    ap.add_argument("--period", type=float, default=0.07, help="seconds a step takes (the sink holds each batch)")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="flowrl-relay-") as tmp:
        flowrl = flowrl_row(Path(tmp), args.steps, args.relays, args.period)
    raw = raw_row(args.steps, args.relays, args.period)
    print(f"CPU per batch (ms, all threads of the process), one batch a step, step ~{args.period * 1e3:.0f} ms, "
          f"{args.relays} relays (flowrl's steps took {flowrl['step_ms']:.1f} ms)")
    print(f"{'process':<12}{'flowrl':>10}{'raw pyzmq':>12}{'flowrl / raw':>14}")
    for k in ("source", "relay", "sink", "controller"):
        print(f"{k:<12}{flowrl[k]:>10.2f}{raw[k]:>12.2f}{flowrl[k] / raw[k]:>13.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"flowrl": flowrl, "raw": raw, **vars(args)}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
