"""Latency of one hop between two processes on this machine: an OS pipe, raw pyzmq, a flowrl channel.

    python benchmarks/hops.py                    # table, ~40 s
    python benchmarks/hops.py --gaps 0.002 0.05 --rounds 200 --json out.json

A message of ~100 bytes goes from process A to process B and straight back (B echoes it), after A
was idle for `gap` seconds; A times the round trip. The gap matters: a CPU left idle for tens of
milliseconds sleeps deeper (on a virtual machine its vCPU halts) and takes longer to wake, and
every hop of a step that waits on another process pays that wake. Methods:

- `pipe`: os.pipe each way, blocking reads: what the OS itself costs (two wakes per round trip);
- `pyzmq ipc`: PUSH/PULL over ipc each way, blocking recv: libzmq's I/O threads add a wake on each
  side of every hop (the sender's I/O thread, the receiver's I/O thread, then the receiver);
- `flowrl channel`: a flowrl Sender/Receiver pair each way (ipc, credit and acks), asyncio on both
  ends, as node processes use them: what one edge of a graph costs a message that waits for nobody.

Last, the same pure-Python loop timed right after each gap, with no hop at all: how much slower
code runs on a CPU that was just idle (cold caches; on a VM, a vCPU the host halted).

What it explains: a strictly on-policy step (`benchmarks/pipeline.py`, k=0) is a chain of such
hops (the rollout's output to the trainer, `published` to the controller, its sync orders, the
handshake's store round trips, the broadcast, the next ticket), each a wake of an idle process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time

PAYLOAD = 96  # bytes of data per message (12 int64s)
TIMEOUT_S = 30.0  # an echo that does not answer within this fails the run


# ------------------------------------------------------------------------------------ pipe
def pipe_echo(r: int, w: int, rounds: int) -> None:
    for _ in range(rounds):
        os.write(w, os.read(r, PAYLOAD))


def pipe_rtts(rounds: int, gap: float) -> list[float]:
    import select

    a_r, a_w = os.pipe()
    b_r, b_w = os.pipe()
    echo = mp.get_context("fork").Process(target=pipe_echo, args=(a_r, b_w, rounds))  # (spawn passes no fds)
    echo.start()
    try:
        out, msg = [], b"x" * PAYLOAD
        for _ in range(rounds):
            time.sleep(gap)
            t = time.perf_counter()
            os.write(a_w, msg)
            if not select.select([b_r], [], [], TIMEOUT_S)[0]:
                raise RuntimeError(f"the pipe echo process did not answer within {TIMEOUT_S} s (exit code {echo.exitcode})")
            os.read(b_r, PAYLOAD)
            out.append(time.perf_counter() - t)
        echo.join(30)
        return out
    finally:
        stop(echo)
        for fd in (a_r, a_w, b_r, b_w):
            os.close(fd)


# ------------------------------------------------------------------------------------ pyzmq
def zmq_echo(there: str, back: str, rounds: int, ready) -> None:
    import zmq

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(there)
    push.connect(back)
    ready.set()
    for _ in range(rounds):
        push.send(pull.recv())
    push.close(linger=1000)
    pull.close(linger=0)
    ctx.term()


def zmq_rtts(ctx, rounds: int, gap: float, tmp: str) -> list[float]:
    import zmq

    there, back = f"ipc://{tmp}/zmq-there", f"ipc://{tmp}/zmq-back"
    zctx = zmq.Context()
    pull = zctx.socket(zmq.PULL)
    pull.bind(back)
    ready = ctx.Event()
    echo = ctx.Process(target=zmq_echo, args=(there, back, rounds, ready))
    echo.start()
    push = zctx.socket(zmq.PUSH)
    try:
        if not ready.wait(60):
            raise RuntimeError("the pyzmq echo process did not start")
        push.connect(there)
        out, msg = [], b"x" * PAYLOAD
        for _ in range(rounds):
            time.sleep(gap)
            t = time.perf_counter()
            push.send(msg)
            if not pull.poll(TIMEOUT_S * 1000):
                raise RuntimeError(f"the pyzmq echo process did not answer within {TIMEOUT_S} s (exit code {echo.exitcode})")
            pull.recv()
            out.append(time.perf_counter() - t)
        echo.join(30)
        return out
    finally:
        stop(echo)
        push.close(linger=0)
        pull.close(linger=0)
        zctx.term()


# ------------------------------------------------------------------------------------ flowrl
def flowrl_echo(there: str, back: str, ready) -> None:
    from flowrl.transport import Batch, ChannelConfig, EndOfStream, Receiver, Sender

    async def main():
        async with Receiver(ChannelConfig(), name="there") as rx, Sender(ChannelConfig(), name="back") as tx:
            await rx.bind(there)
            await tx.connect(back)
            ready.set()
            while True:
                try:
                    b = await rx.recv()
                except EndOfStream:
                    break
                await rx.ack(b)
                await tx.send(Batch(tensors=b.tensors, batch_id=b.batch_id))
            await tx.end_of_stream()

    asyncio.run(main())


def flowrl_rtts(ctx, rounds: int, gap: float, tmp: str) -> list[float]:
    import numpy as np

    from flowrl.transport import Batch, ChannelConfig, EndOfStream, Receiver, Sender

    there, back = f"ipc://{tmp}/flowrl-there", f"ipc://{tmp}/flowrl-back"
    ready = ctx.Event()
    echo = ctx.Process(target=flowrl_echo, args=(there, back, ready))

    async def main() -> list[float]:
        async with Receiver(ChannelConfig(), name="back") as rx, Sender(ChannelConfig(), name="there") as tx:
            await rx.bind(back)
            echo.start()
            while not ready.is_set():  # (the echo's imports take a second or two)
                if not echo.is_alive():
                    raise RuntimeError(f"the flowrl echo process exited with {echo.exitcode}")
                await asyncio.sleep(0.05)
            await tx.connect(there)
            tokens = np.arange(PAYLOAD // 8, dtype=np.int64)
            out = []
            for i in range(rounds + 2):  # two to warm up (connection, first credit)
                await asyncio.sleep(gap)
                t = time.perf_counter()
                await tx.send(Batch(tensors={"tokens": tokens}, batch_id=f"p{i}"))
                b = await asyncio.wait_for(rx.recv(), TIMEOUT_S)
                await rx.ack(b)
                if i >= 2:
                    out.append(time.perf_counter() - t)
            await tx.end_of_stream()
            try:  # the echo's end of stream: both ends close in order
                await asyncio.wait_for(rx.recv(), TIMEOUT_S)
            except EndOfStream:
                pass
            return out

    try:
        out = asyncio.run(main())
        echo.join(30)
        return out
    finally:
        stop(echo)


# ------------------------------------------------------------------------------------ driver
def stop(p) -> None:
    if p.pid is not None and p.is_alive():
        p.kill()
        p.join()


METHODS = ("pipe", "pyzmq ipc", "flowrl channel")


def measure(method: str, rounds: int, gap: float, tmp: str) -> dict:
    ctx = mp.get_context("spawn")
    if method == "pipe":
        rtts = pipe_rtts(rounds, gap)
    elif method == "pyzmq ipc":
        rtts = zmq_rtts(ctx, rounds, gap, tmp)
    else:
        rtts = flowrl_rtts(ctx, rounds, gap, tmp)
    us = sorted(x * 1e6 for x in rtts[max(1, rounds // 10):])  # the first rounds: connection and page faults
    return {"method": method, "gap_s": gap, "rounds": len(us), "rtt_median_us": statistics.median(us),
            "rtt_p90_us": us[int(0.9 * (len(us) - 1))]}


def cold_loop(gap: float, rounds: int) -> float:
    """Median microseconds of the same pure-Python loop (2,000 iterations) run right after `gap`
    seconds of sleep: what an idle CPU costs code that runs on it next, without any hop."""
    def work() -> int:
        s = 0
        for i in range(2000):
            s += i * i
        return s

    out = []
    for _ in range(rounds):
        if gap:
            time.sleep(gap)
        t = time.perf_counter()
        work()
        out.append((time.perf_counter() - t) * 1e6)
    return statistics.median(out[max(1, rounds // 10):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--gaps", type=float, nargs="+", default=[0.002, 0.05], help="idle seconds before each message")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="flowrl-hops-")
    try:
        rows = [measure(m, args.rounds, gap, tmp) for gap in args.gaps for m in args.methods]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"round trip of a {PAYLOAD}-byte message between 2 processes after an idle gap; {args.rounds} rounds, "
          f"{os.cpu_count()} CPUs\n")
    print(f"{'idle gap':>9}  {'method':<15} {'RTT median us':>14} {'RTT p90 us':>11} {'one way us':>11}")
    for r in rows:
        print(f"{r['gap_s'] * 1e3:>7.0f}ms  {r['method']:<15} {r['rtt_median_us']:>14.0f} {r['rtt_p90_us']:>11.0f} "
              f"{r['rtt_median_us'] / 2:>11.0f}")
    loops = {gap: cold_loop(gap, min(args.rounds, 100)) for gap in [0.0, *args.gaps]}
    print("\nthe same pure-Python loop (2,000 iterations, no hop) right after the idle gap, median us: "
          + ", ".join(f"{gap * 1e3:.0f} ms: {us:.0f}" for gap, us in loops.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "cold_loop_us": {str(g): us for g, us in loops.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
