"""What a stranger's ZeroMQ socket gets from a CURVE server: the handshake outcome, as the client's
socket monitor reports it (a ZAP refusal is `EVENT_HANDSHAKE_FAILED_AUTH`: the server never hands
anything from that connection to its application)."""

from __future__ import annotations

import time

import zmq
from zmq.utils.monitor import recv_monitor_message

OUTCOMES = {zmq.EVENT_HANDSHAKE_SUCCEEDED: "succeeded", zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused",
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol error",
            zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "failed"}


def handshake(address: str, server_key: str | None, client: tuple[str, str] | None = None,
              timeout_s: float = 5.0, send: bytes | None = b"hello?") -> str:
    """Connect a DEALER to `address` as a CURVE client (a made-up key pair unless `client` is
    given), send `send`, and return how the handshake ended: succeeded | refused | ... | timeout."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if server_key is not None:
        public, secret = client or tuple(k.decode() for k in zmq.curve_keypair())
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
            server_key.encode(), public.encode(), secret.encode())
    mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                  | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    try:
        sock.connect(address)
        if send is not None:
            sock.send(send, zmq.NOBLOCK)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if mon.poll(100):
                return OUTCOMES.get(recv_monitor_message(mon)["event"], "other")
        return "timeout"
    finally:
        sock.disable_monitor()
        mon.close(0)
        sock.close(0)
        ctx.term()


def speaks_zmtp(address: str, timeout_s: float = 1.0) -> bool:
    """Whether the tcp listener at `address` is a ZeroMQ socket: a ZMTP 3 peer sends its greeting
    (0xFF, 8 bytes, 0x7F) as soon as a connection opens, while gloo's sockets and a c10d store wait
    for the client to speak. A closed port is not one."""
    import socket

    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
            greeting = b""
            while len(greeting) < 10:
                chunk = s.recv(10 - len(greeting))
                if not chunk:
                    break
                greeting += chunk
    except OSError:  # refused, reset or silent until the timeout
        return False
    return len(greeting) == 10 and greeting[0] == 0xFF and greeting[9] == 0x7F
