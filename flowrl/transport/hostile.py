"""Hostile traffic against a channel consumer: what a stray local process, a careless user or an
attacker could write to its socket. Used by the live-channel fuzz test and benchmark, and meant to be
pointed at any running consumer (a node's input) the same way:

    python -m flowrl.transport.hostile ADDRESS --count 20000 [--secret-hex HEX] [--seed 0]

It prints one JSON line when done: {"event": "done", "sent": {kind: count}, "total": N}.

Strangers (no secret) send random bytes, truncated and lying messages, forged hellos (no proof, a
wrong one, absurd fields), bombs (deep nesting in meta and where an error message quotes the value,
a bundle of a million parts, frames past the socket's limit, msgpack that declares gigabytes),
floods of hellos from fresh routing ids, and the libzmq abort burst (more queued messages than the
receive high-water mark, then a disconnect, with ZeroMQ heartbeats on). With `--secret-hex` an
*insider* (a link that knows the secret: a buggy producer) also hoards credit, asks for more than a
link may hold, sends without credit, replays acknowledged batches and sends well-formed batches with
lying tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import msgpack
import numpy as np
import zmq

from flowrl.transport import codec, security, wire
from flowrl.transport.batch import Batch

V = wire.SCHEMA_VERSION


def _pack(h) -> bytes:
    return msgpack.packb(h, use_bin_type=True)


def _hello(rng: random.Random, **kw) -> dict:
    h = {"v": V, "kind": "hello", "ch": "x", "state": "open", "need": 0, "idle": False, "ret_m": 0, "ret_b": 0}
    h.update(kw)
    return h


def _data_frames(i: int, envelope: list | None = None, **over) -> list[bytes]:
    """A well-formed batch's frames, with its `envelope` ([incarnation, seq]) and header fields
    replaced by `over` (by name: `wire.DATA_FIELDS`; an `env` there wins over `envelope`)."""
    b = Batch(tensors={"x": np.arange(i % 7 + 1, dtype=np.int64), "y": np.ones((i % 7 + 1, 600), np.float32)},
              meta={"i": i}, batch_id=f"hostile{i}")
    frames = [bytes(memoryview(f).cast("B")) for f in codec.encode(b)]
    if envelope is not None or over:
        h = msgpack.unpackb(frames[0], raw=False)
        over.setdefault("env", envelope)
        for name, value in over.items():
            h[wire.DATA_FIELDS.index(name)] = value
        frames[0] = _pack(h)
    return frames


def _data_header(**fields) -> list:
    """A data header of defaults with `fields` (by name) set: what a lie needs around it."""
    h = [V, wire.DATA, "lie", 0, 0, {}, [], None, None, None]
    for name, value in fields.items():
        h[wire.DATA_FIELDS.index(name)] = value
    return h


_BOMBS: dict[str, bytes] = {}


def _bomb(kind: str) -> bytes:
    """Expensive hostile headers, built once."""
    if kind not in _BOMBS:
        if kind == "nesting":
            deep: object = 1
            for _ in range(1000):
                deep = [deep]
            _BOMBS[kind] = _pack(_data_header(meta={"d": deep}))
        else:
            _BOMBS[kind] = _pack({"v": V, "kind": "bundle", "parts": [1] * (1_000_000 if kind == "bundle" else 1000)})
    return _BOMBS[kind]


def _stranger_message(rng: random.Random, i: int) -> tuple[str, list[bytes]]:
    """One hostile message from a process that does not know the secret: (kind, frames)."""
    k = rng.randrange(12)
    if k == 0:
        return "random", [rng.randbytes(rng.randrange(0, 300)) for _ in range(rng.randrange(1, 5))]
    if k == 1:
        frames = _data_frames(i, ["0" * 16, i])
        j = rng.randrange(len(frames))
        frames[j] = frames[j][:rng.randrange(len(frames[j]) + 1)]
        return "truncated", frames
    if k == 2:
        lie = rng.choice([{"policy_version": True}, {"policy_version": 1.0}, {"attempt": -1}, {"v": True},
                          {"v": 1.0}, {"batch_id": 7}, {"route": [0, 0, 0]}, {"meta": {"a": {1: 2}}},
                          {"tensors": [["x", "int64", [1 << 40], "numpy", 1, None]]}, {"env": {"inc": "0", "seq": 1}},
                          {"tensors": [{"name": "x", "dtype": "int64", "shape": [1], "lib": "numpy",
                                        "data": b"0" * 8}]}])  # a descriptor of schema version 1
        return "lying_header", _data_frames(i, ["0" * 16, i], **lie)
    if k == 3 and i % 2:  # a value nested 1,000 deep where an error message quotes it (1 KB)
        frames = _data_frames(i, ["0" * 16, i], **{rng.choice(("batch_id", "v", "env", "route")): "DEEP"})
        return "bomb_quoted", [frames[0].replace(_pack("DEEP"), b"\x91" * 1000 + b"\x01"), *frames[1:]]
    if k == 3:
        return "bomb_nesting", [_bomb("nesting")]
    if k == 4 and rng.random() < 0.05:  # a bundle of a million one-byte parts (the header alone is ~1 MB)
        return "bomb_bundle", [_bomb("bundle"), b"\x00" * 1_000_000]
    if k == 4:  # a bundle of more parts than allowed, small enough to pass the pre-hello limit
        return "bomb_parts", [_bomb("parts"), b"\x00" * 1000]
    if k == 5:  # msgpack that declares a 4 GiB bin and stops
        return "bomb_declared", [b"\x81\xa1v\xc6\xff\xff\xff\xff" + rng.randbytes(16)]
    if k == 6:
        return "hello_no_proof", [_pack(_hello(rng))]
    if k == 7:
        return "hello_bad_proof", [_pack(_hello(rng, mac=rng.randbytes(wire.MAC_BYTES)))]
    if k == 8:
        return "hello_absurd", [_pack(_hello(rng, **rng.choice([{"need": 1 << 62}, {"need": True}, {"idle": 1},
                                                               {"ret_m": -5}, {"shm": {"pid": 1, "fd": 0, "key": "k"}},
                                                               {"mac": "x" * 32}, {"state": "eos"}])))]
    if k == 9:
        return "forged_data", _data_frames(i, [rng.randbytes(8).hex(), rng.randrange(1, 1 << 30)])
    if k == 10:
        return "status_to_consumer", [_pack({"v": V, "kind": "status", "ch": "x", "inc": "y", "known": True,
                                             "closing": False, "cap_m": 1, "cap_b": 1, "max_msg": 1, "lim_m": 9,
                                             "lim_b": 9, "acks": [], "eos_ack": False})]
    return "empty_frames", [b""] * rng.randrange(1, 4)


class Insider:
    """A link that knows the channel's secret and then misbehaves (a buggy producer)."""

    def __init__(self, ctx: zmq.Context, address: str, secret: bytes, rng: random.Random):
        self.ctx, self.address, self.secret, self.rng = ctx, address, secret, rng
        self.sock = None
        self.epoch = 0
        self.hoarding: list = []  # earlier links, left open: they sit on their credit until reclaimed

    def join(self, need: int = 0) -> wire.Status | None:
        """A fresh link: hello, nonce, proven hello; returns the consumer's welcome (or None)."""
        if self.sock is not None:
            self.hoarding.append(self.sock)
        self.epoch += 1
        self.rid = f"insider{os.getpid()}.{self.epoch}".encode()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, self.rid)
        self.sock.connect(self.address)
        for _ in range(20):  # a first hello is answered at a bounded rate: retry, as a producer does
            self.sock.send(_pack(_hello(self.rng)))
            st = self.status(lambda s: s.nonce is not None, timeout=0.1)
            if st is not None:
                break
        else:
            return None
        self.mac = security.proof(self.secret, st.nonce, self.rid)
        self.sock.send(_pack(_hello(self.rng, mac=self.mac, need=need)))
        return self.status(lambda s: s.known)

    def status(self, want, timeout: float = 2.0) -> wire.Status | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sock.poll(50):
                h = wire.unpack_header(self.sock.recv(), wire.DecodeLimits())
                st = wire.Status.from_header(h)
                if want(st):
                    return st
        return None

    def misbehave(self, i: int, link_bytes: int) -> list[tuple[str, int]]:
        """One round of insider abuse; returns (kind, messages sent) pairs."""
        out = []
        st = self.join(need=min(link_bytes, 1 << 20))  # hoard: ask for a lot, then send nothing
        if st is None:
            return [("insider_unanswered", 1)]
        out.append(("hoard", 2))
        self.sock.send(_pack(_hello(self.rng, mac=self.mac, need=link_bytes * 10)))
        out.append(("need_too_large", 1))
        frames = _data_frames(i, [st.inc, 1])
        self.sock.send_multipart(frames)
        acked = self.status(lambda s: 1 in s.acks)
        self.sock.send_multipart(frames)  # the same batch again, after (or without) its ack
        out.append(("replay_after_ack" if acked else "replay", 2))
        for seq, lie in enumerate([{"policy_version": True}, {"policy_version": 1.0}, {"v": True},
                                   {"tensors": [["x", "int64", [3], "numpy", b"\x00" * 5, None]]}], start=2):
            self.sock.send_multipart(_data_frames(i, [st.inc, seq], **lie))
        out.append(("insider_lies", 4))
        for _ in range(2):  # the second is past what it was granted
            self.sock.send_multipart([_pack(_data_header(env=[st.inc, 9])), b"\x00" * (link_bytes - 8192)])
        out.append(("over_credit", 2))
        return out

    def close(self) -> None:
        for sock in self.hoarding + ([self.sock] if self.sock is not None else []):
            sock.close(linger=0)


def abort_burst(ctx: zmq.Context, address: str, count: int = 3000) -> int:
    """The libzmq 4.3.5 abort: a burst past the receiver's high-water mark, then a disconnect, with
    ZeroMQ heartbeats on (on the attacker's side; the consumer's own options decide if it aborts)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 100)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 1000)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(address)
    for _ in range(count):
        sock.send(b"\x00" * 64)
    sock.close(linger=500)
    return count


def flood(address: str, rng: random.Random, n: int = 200) -> None:
    """`n` hellos, each from a fresh socket (a fresh routing id), in a context of their own: its term()
    returns once the last of them has lingered out. Closed sockets count against a context's socket
    limit (and their files against the process's) until libzmq's reaper frees them; in one shared
    context, floods on a loaded machine outran the reaper and the next socket() failed with EMFILE."""
    with zmq.Context() as ctx:
        for _ in range(n):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 50)
            s.connect(address)
            s.send(_pack(_hello(rng)))
            s.close()


def run(address: str, count: int, secret: bytes | None = None, seed: int = 0, link_bytes: int = 1 << 20,
        bursts: int = 2) -> dict:
    """Send at least `count` hostile messages to the consumer at `address` (plus `bursts` abort bursts
    of 3,000); returns counts by kind."""
    rng = random.Random(seed)
    ctx = zmq.Context()
    sent: dict[str, int] = {}
    sock, total, i = None, 0, 0
    insider = Insider(ctx, address, secret, rng) if secret else None
    try:
        while total < count:
            if sock is None or i % 200 == 0:  # a fresh stranger now and then (and after a cut-off)
                if sock is not None:
                    sock.close(linger=0)
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.connect(address)
            i += 1
            if i % 1000 == 0:  # a flood of hellos, each from a fresh routing id
                flood(address, rng)
                sent["flood_hello"] = sent.get("flood_hello", 0) + 200
                total += 200
            if i % 2500 == 0 and insider is not None:
                for kind, n in insider.misbehave(i, link_bytes):
                    sent[kind] = sent.get(kind, 0) + n
                    total += n
            if bursts and i % max(1, count // (bursts + 1)) == 0:
                bursts -= 1
                with zmq.Context() as burst_ctx:  # its own context: term() waits out the linger
                    sent["abort_burst"] = sent.get("abort_burst", 0) + abort_burst(burst_ctx, address)  # on top of count
            if i % 5000 == 0:  # a frame past the socket's limit from a link that never said hello
                sock.send(b"\x00" * (8 << 20))
                sent["big_frame"] = sent.get("big_frame", 0) + 1
                total += 1
                continue
            kind, frames = _stranger_message(rng, i)
            sock.send_multipart(frames)
            sent[kind] = sent.get(kind, 0) + 1
            total += 1
            if i % 64 == 0:
                time.sleep(0.001)  # let the consumer's socket drain a little: pressure, not a wall
    finally:
        if insider is not None:
            insider.close()
        if sock is not None:
            sock.close(linger=200)
        ctx.term()
    return {"sent": sent, "total": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("address")
    ap.add_argument("--count", type=int, default=20_000)
    ap.add_argument("--secret-hex", default=None, help="the channel secret: adds an insider that misbehaves")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--link-bytes", type=int, default=1 << 20, help="the consumer's link_capacity_bytes")
    ap.add_argument("--bursts", type=int, default=2, help="abort bursts (3,000 messages then a disconnect)")
    args = ap.parse_args()
    t0 = time.monotonic()
    out = run(args.address, args.count, bytes.fromhex(args.secret_hex) if args.secret_hex else None, args.seed,
              args.link_bytes, args.bursts)
    print(json.dumps({"event": "done", "seconds": round(time.monotonic() - t0, 2), **out}), flush=True)


if __name__ == "__main__":
    main()
