"""A producer whose host stops answering (no FIN, no RST), seen from its consumer, in a network
namespace the test makes (every packet stays in it):

    unshare -n sh -c 'ip link set lo up && exec python -m tests.transport.vanished_host'

A Receiver and a Sender on tcp over loopback exchange one batch; then traffic control parks every
packet to or from the channel's port in a queue that never gets to send it (`park`; the kernel of
a lean VM may lack netem and drop actions: htb, pfifo and u32 are enough), so each side's writes
stay unacknowledged and nothing is reported back, as towards a host that lost power. The consumer's `recv()` must end with
BrokenChannel. Prints one JSON line: {"outcome": "broken" | "waiting" | "skip", "after_s", "text"}.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import anyio
import numpy as np

from flowrl.transport import Batch, BrokenChannel, ChannelConfig, Receiver, Sender

WAIT_S = 60.0  # the consumer waits this long for its recv() to end (without TCP_MAXRT: ~15 minutes)


def park(port: int) -> str | None:
    """Hold every packet to or from `port` in a queue that never gets to send them (None), or why this
    kernel cannot (the test skips). Held, not dropped: a packet the local queue drops is reported to
    TCP, which then retries every half second and gives up in seconds, unlike towards a vanished
    host. The queue sends a byte a second, and datagrams to a port nobody uses (9) first spend its
    burst and then sit at its head for longer than the test runs."""
    cmds = ["tc qdisc add dev lo root handle 1: htb default 10",
            "tc class add dev lo parent 1: classid 1:10 htb rate 10gbit",
            "tc class add dev lo parent 1: classid 1:20 htb rate 8bit ceil 8bit burst 2k cburst 2k",
            "tc qdisc add dev lo parent 1:20 handle 20: pfifo limit 100000",
            "tc filter add dev lo parent 1: protocol ip prio 1 u32 match ip dport 9 0xffff flowid 1:20"]
    for cmd in cmds:
        done = subprocess.run(cmd.split(), capture_output=True, text=True)
        if done.returncode:
            return f"`{cmd}` failed: {done.stderr.strip()[:200]}"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _ in range(4):
            s.sendto(bytes(1400), ("127.0.0.1", 9))
    for cmd in [f"tc filter add dev lo parent 1: protocol ip prio 1 u32 match ip dport {port} 0xffff flowid 1:20",
                f"tc filter add dev lo parent 1: protocol ip prio 1 u32 match ip sport {port} 0xffff flowid 1:20"]:
        done = subprocess.run(cmd.split(), capture_output=True, text=True)
        if done.returncode:
            return f"`{cmd}` failed: {done.stderr.strip()[:200]}"
    return None


async def one_batch_over_tcp(rx: Receiver, tx: Sender) -> int:
    """Bind `rx` on loopback, connect `tx`, move one batch; returns the channel's port."""
    address = await rx.bind("tcp://127.0.0.1:0")
    await tx.connect(address)
    await tx.send(Batch(tensors={"x": np.arange(4)}, batch_id="b0"))
    await rx.ack(await rx.recv())
    return int(address.rsplit(":", 1)[1])


async def main() -> dict:
    config = ChannelConfig(heartbeat_s=0.5, peer_timeout_s=2.0, transport="tcp")
    async with Receiver(config, name="consumer") as rx, Sender(config, name="producer") as tx:
        why = park(await one_batch_over_tcp(rx, tx))
        if why:
            return {"outcome": "skip", "after_s": 0.0, "text": why}
        t0 = time.monotonic()
        try:
            with anyio.fail_after(WAIT_S):
                await rx.recv()
        except BrokenChannel as e:
            return {"outcome": "broken", "after_s": time.monotonic() - t0, "text": str(e)}
        except TimeoutError:
            return {"outcome": "waiting", "after_s": time.monotonic() - t0,
                    "text": f"recv() still waiting; links {rx.statistics().peers}, lost {rx.statistics().peers_lost}"}
        return {"outcome": "batch", "after_s": time.monotonic() - t0, "text": "a batch came through the parked port"}


if __name__ == "__main__":
    print(json.dumps(anyio.run(main)), flush=True)
    sys.exit(0)
