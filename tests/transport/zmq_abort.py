"""The libzmq 4.3.5 abort, with plain pyzmq (run in a child process: it kills the process).

    python tests/transport/zmq_abort.py repro hb|nohb    # a ROUTER and a burst in one process
    python tests/transport/zmq_abort.py attack ADDRESS   # the burst against someone else's socket

A connection with ZeroMQ heartbeats on whose receive pipe reaches its high-water mark (RCVHWM, 1,000
by default) and whose peer then disconnects makes the next read of the socket fail
`Assertion failed: !_io_error (src/stream_engine_base.cpp:310)` and abort() the whole process.
"""

import sys
import time

import zmq

BURST = 3000


def burst(ctx: zmq.Context, address: str, heartbeats: bool = True) -> None:
    sock = ctx.socket(zmq.DEALER)
    if heartbeats:
        sock.setsockopt(zmq.HEARTBEAT_IVL, 100)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 1000)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(address)
    for _ in range(BURST):
        sock.send(b"\x00" * 100)
    sock.close(linger=1000)


def repro(heartbeats: bool) -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    if heartbeats:
        router.setsockopt(zmq.HEARTBEAT_IVL, 100)
        router.setsockopt(zmq.HEARTBEAT_TIMEOUT, 1000)
        router.setsockopt(zmq.HEARTBEAT_TTL, 1000)
    router.setsockopt(zmq.RCVHWM, 1000)
    router.bind("tcp://127.0.0.1:0")
    address = router.getsockopt(zmq.LAST_ENDPOINT).decode()
    for _ in range(3):  # three rounds: the pipe fills, the peer leaves, the router reads
        peer = zmq.Context()
        burst(peer, address, heartbeats=False)
        peer.term()  # every message written, the connection closed
        # let the ROUTER's I/O thread see the close while its pipe is full. A wait, not a condition:
        # nothing marks that moment (no monitor event comes before the abort); with heartbeats the
        # I/O thread aborts on its own at a heartbeat in this time, without a read, and without them
        # it sees nothing of a tcp close until the router reads (no PING, so no RST: only the FIN)
        time.sleep(0.3)
        got = 0
        while router.poll(200):
            router.recv_multipart()
            got += 1
        print(f"survived a round; read {got} of {BURST}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "repro":
        repro(sys.argv[2] == "hb")
    else:
        ctx = zmq.Context()
        burst(ctx, sys.argv[2])
        ctx.term()
        print('{"event": "sent"}', flush=True)
