"""Wire types: the only thing both ends of a channel share. Written down once, versioned.

Every message is a ZeroMQ multipart message whose frame 0 is msgpack starting with `v`
(= `SCHEMA_VERSION`) and `kind`: a map for the control messages, an array for `data`. Three kinds
exist, and a fourth that carries several of them:

`data` (producer -> consumer), frames 1..n are raw C-contiguous little-endian tensor buffers. Its
header is an array of `DATA_FIELDS`, one per batch and decoded per batch, so positional: a map of
the same values costs its consumer two and a half times as much to decode (its keys are strings
made anew per message)::

    [v, "data", batch_id: str, attempt: int, policy_version: int, meta: {...},
     tensors: [[name, dtype, shape: [int], lib: "numpy"|"torch", at, offsets], ...],
     route: [index, min_version, epoch, drop] | nil,  # routing facts; nil when all are defaults
     env: [inc: str, seq: int] | nil,                 # channel envelope; nil from `codec.encode`
     shm: [block id, fd, used bytes] | nil]           # shared memory; then frame 0 is all there is

    at: bin (a tiny tensor's bytes, inline) | int (without `shm`: the frame i holding its bytes;
        with `shm`: the offset of its bytes in the block)
    offsets: nil | [shape, at]   # a ragged tensor's int64 offsets, stored as its values are

Shared memory (`shm.py`) carries the tensors of large messages between processes on one host: the
producer copies them into a block of its memory that the consumer maps (after a probe announced
in the hello succeeded: `shm_max` > 0 in its status), and the consumer hands blocks back (`freed`) once
nothing refers to them. Such a message counts as len(frame 0) + used bytes towards credit.

`hello` (producer -> consumer): announces a producer link and its state; sent on connect, on every
heartbeat and whenever the state changes (idempotent: all counters are cumulative)::

    {v, kind: "hello", ch: the producer's channel name (a label for logs; several edges may feed
     one consumer), state: "open"|"eos"|"bye"|"relink",
     need: bytes of the message it is blocked on (0: not blocked), idle: bool,
     ret_m: int, ret_b: int,                    # credit handed back so far (messages, bytes)
     shm: {pid, fd, key},                       # optional: the probe of this link's shared memory
     mac: bin,                                  # optional: HMAC-SHA256(secret, nonce) (channel secret)
     inc: str}                                  # optional: the consumer incarnation this link knows
                                                # (a socket that reconnected to a restarted consumer
                                                # is told to start a new link)

`status` (consumer -> one producer link): welcome, credit grant, acks and heartbeat in one
idempotent message::

    {v, kind: "status", ch, inc: consumer incarnation id, known: bool (false: hello again),
     closing: bool, cap_m, cap_b, max_msg: the consumer's limits,
     lim_m, lim_b: cumulative credit limits of this link, acks: [seq, ...], eos_ack: bool,
     shm_max: int, freed: [block id, ...],     # optional: bytes of the producer's shared memory it
                                               # maps at most (0: none) / blocks released
     nonce: bin}                               # optional, with known=false: prove the secret on it

`bundle` (producer -> consumer): one-frame `data` and `hello` messages written in one burst travel
as one ZeroMQ message of two frames, which saves each of them a receive call and the work of both
ZeroMQ I/O threads::

    {v, kind: "bundle", parts: [byte length of message 1, of message 2, ...]}
    frame 1: the frames of message 1, 2, ... back to back

The consumer handles the parts in order, each exactly as if it had come alone (its own checks, its
own credit, its own rejection); a bundle inside a bundle is refused, and so is one of more than
`MAX_BUNDLE_PARTS` parts (whole: its CPU cost is bounded before any part is looked at).

A producer may have sent message number k (counting from 1 on its link) of s bytes only while
k <= lim_m and (bytes sent before) + s <= lim_b, minus what it handed back (`ret_m`, `ret_b`).
Decoding is bounded by `DecodeLimits`; any violation raises `DecodeError`.
"""

from __future__ import annotations

import reprlib
import threading
from dataclasses import dataclass, field
from typing import Any

import msgpack

from flowrl.transport.errors import DecodeError

SCHEMA_VERSION = 2  # 2: the data header became an array
DATA, HELLO, STATUS, BUNDLE = "data", "hello", "status", "bundle"
HELLO_STATES = ("open", "eos", "bye", "relink")
MAX_BUNDLE_PARTS = 256  # a producer bundles at most sockets.CORK_MESSAGES (64) messages
MAC_BYTES = 32  # HMAC-SHA256
NONCE_BYTES = 16
MAX_STR = 256
_I64 = 1 << 63
DATA_FIELDS = ("v", "kind", "batch_id", "attempt", "policy_version", "meta", "tensors", "route", "env", "shm")
DATA_LEN = len(DATA_FIELDS)
D_ID, D_TENSORS, D_ENV, D_SHM = 2, 6, 8, 9  # positions in a data header (see DATA_FIELDS)
TENSOR_FIELDS = ("name", "dtype", "shape", "lib", "at", "offsets")


@dataclass(frozen=True)
class DecodeLimits:
    """Bounds on what a decoder accepts from untrusted bytes."""

    max_header_bytes: int = 1 << 20
    """Size of frame 0 (the msgpack header, inline tensors included)."""
    max_frames: int = 1024
    """Frames in one message."""
    max_message_bytes: int = 1 << 30
    """All frames of one message together."""
    max_depth: int = 32
    """Nesting of lists / maps in `meta`."""
    max_tensors: int = 1024
    """Tensors in one batch."""
    max_ndim: int = 32
    """Dimensions of one tensor."""


_local = threading.local()
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict = 2, 40, 40, 4, 4


def short(value: Any, limit: int = 40) -> str:
    """A repr of an unchecked value for an error message: nesting cut after two levels and at most
    `limit` characters. (`f"{v!r:.40}"` cuts only after building the whole repr, and a list nested
    a thousand deep, 1 KB of msgpack, makes that repr raise RecursionError.)"""
    return _SHORT.repr(value)[:limit]


def pack(header: dict) -> bytes:
    """msgpack bytes of `header` (a Packer per thread: cheaper than `packb` for small maps), whose
    values the caller made or checked (`check_meta`)."""
    packer = getattr(_local, "packer", None)
    if packer is None:
        packer = _local.packer = msgpack.Packer(use_bin_type=True)
    return packer.pack(header)


def pack_bundle(counts: list[int]) -> bytes:
    return pack({"v": SCHEMA_VERSION, "kind": BUNDLE, "parts": counts})


def bundle_parts(header: dict, frames: int, blob_bytes: int) -> list[int]:
    """The checked part sizes of a bundle whose frame 0 is `header`, in a message of `frames`
    frames whose frame 1 holds `blob_bytes`."""
    check_keys(header, _BUNDLE_KEYS, where="bundle")
    parts = header["parts"]
    if frames != 2:
        raise DecodeError("bad_frames", f"a bundle has 2 frames, got {frames}")
    if type(parts) is not list or not 0 < len(parts) <= MAX_BUNDLE_PARTS:
        raise DecodeError("bundle_parts", f"a bundle has 1..{MAX_BUNDLE_PARTS} parts, this one "
                                          f"{len(parts) if type(parts) is list else short(parts, 20)}")
    for n in parts:  # (a loop, not any(genexpr): no generator resumed per part)
        if type(n) is not int or n < 1:
            raise DecodeError("bad_field", "bundle parts must be a non-empty list of ints >= 1")
    if sum(parts) != blob_bytes:
        raise DecodeError("bad_field", f"bundle parts add up to {sum(parts)} bytes, frame 1 has {blob_bytes}")
    return parts


def unpack_header(buf: Any, limits: DecodeLimits) -> dict | list:
    """Frame 0 -> header: a map (control messages) or a `data` array of len(DATA_FIELDS) items,
    after the size, msgpack, version and kind checks."""
    size = buf.nbytes if type(buf) is memoryview else len(buf)
    if size > limits.max_header_bytes:
        raise DecodeError("header_too_large", f"header of {size} bytes exceeds max_header_bytes="
                                              f"{limits.max_header_bytes}")
    try:
        header = msgpack.unpackb(buf, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # noqa: BLE001 - any malformed input is one error type
        raise DecodeError("bad_msgpack", f"frame 0 is not msgpack ({type(e).__name__}: {e})") from None
    if type(header) is list:
        if len(header) != DATA_LEN or type(v := header[0]) is not int or v != SCHEMA_VERSION \
                or header[1] != DATA:
            raise DecodeError(*_array_problem(header))
        return header
    if type(header) is not dict:
        raise DecodeError("bad_header", f"frame 0 holds a {type(header).__name__}, not a map or a data array")
    v = header.get("v")
    if type(v) is not int or v != SCHEMA_VERSION:  # True == 1 and 1.0 == 1 in Python: not on the wire
        raise DecodeError("bad_version", f"schema version {short(v, 20)}; this side speaks {SCHEMA_VERSION}")
    kind = header.get("kind")
    if kind not in (HELLO, STATUS, BUNDLE):  # (a tuple: compares, never hashes a hostile value)
        if kind == DATA:
            raise DecodeError("bad_header", f"a data header is an array of {len(DATA_FIELDS)} items "
                                            f"{DATA_FIELDS}, not a map")
        raise DecodeError("bad_kind", f"unknown message kind {short(kind)}")
    return header


def _array_problem(header: list) -> tuple[str, str]:
    """Why an array header is not a data header: (reason, text)."""
    v = header[0] if header else None
    if type(v) is not int or v != SCHEMA_VERSION:
        return "bad_version", f"schema version {short(v, 20)}; this side speaks {SCHEMA_VERSION}"
    if len(header) < 2 or header[1] != DATA:
        kind = header[1] if len(header) > 1 else None
        return "bad_kind", f"an array header must be a data message, got kind {short(kind)}"
    return "bad_header", f"a data header has {len(DATA_FIELDS)} items {DATA_FIELDS}, this one {len(header)}"


# ----------------------------------------------------------------------------------- field checks
def check_keys(d: Any, required: frozenset, optional: frozenset = frozenset(), where: str = "header") -> dict:
    if not isinstance(d, dict):
        raise DecodeError("bad_field", f"{where} must be a map, got {type(d).__name__}")
    keys = d.keys()
    if not required <= keys:
        raise DecodeError("missing_key", f"{where} lacks {sorted(required - keys)}")
    extra = keys - required - optional
    if extra:
        raise DecodeError("unknown_key", f"{where} has unknown keys {sorted(extra, key=repr)[:5]}")
    return d


def get_int(d: dict, key: str, lo: int = -_I64, hi: int = _I64 - 1) -> int:
    return check_int(key, d[key], lo, hi)


def check_int(name: str, v: Any, lo: int = -_I64, hi: int = _I64 - 1) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise DecodeError("bad_field", f"{name} must be an int in [{lo}, {hi}], got {short(v)}")
    return v


def get_str(d: dict, key: str, max_len: int = MAX_STR, allow_empty: bool = False) -> str:
    return check_str(key, d[key], max_len, allow_empty)


def check_str(name: str, v: Any, max_len: int = MAX_STR, allow_empty: bool = False) -> str:
    if type(v) is not str or len(v) > max_len or (not v and not allow_empty):
        raise DecodeError("bad_field", f"{name} must be a str of 1..{max_len} chars, got {short(v)}")
    return v


def get_bool(d: dict, key: str) -> bool:
    v = d[key]
    if type(v) is not bool:
        raise DecodeError("bad_field", f"{key} must be a bool, got {short(v)}")
    return v


def check_meta(meta: dict) -> None:
    """Before a batch is encoded: `meta` holds what `check_json` lets through at the consumer (a
    subclass of str, int or float, such as numpy's float64, and a tuple travel as the plain value and
    a list). Raises TypeError naming the first value that does not, at the sender, where the code that
    put it there is; MAX_META_DEPTH bounds the walk (a list that holds itself)."""
    problem = _json_problem(meta, MAX_META_DEPTH, lenient=True)
    if problem is not None:
        raise TypeError(f"meta {problem[1]} (str, int, float, bool, None, lists and dicts with str keys)")


MAX_META_DEPTH = 512


def check_json(value: Any, max_depth: int, where: str = "meta") -> None:
    """JSON-like values only, nested at most `max_depth` deep (iterative: no recursion limit)."""
    problem = _json_problem(value, max_depth)
    if problem is not None:
        raise DecodeError(problem[0], f"{where} {problem[1]}")


def _json_problem(value: Any, max_depth: int, lenient: bool = False) -> tuple[str, str] | None:
    """(reason, what) for the first value that is not JSON-like, or None. `lenient` (what encodes):
    subclasses of the JSON types and tuples too; else (what was decoded) the exact types only."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        t = type(v)
        if t is str or t is int or t is float or t is bool or v is None:
            continue
        if depth > max_depth:
            return "depth", f"nests deeper than max_depth={max_depth}"
        if t is list or t is dict or not lenient:
            pass
        elif isinstance(v, dict):
            t = dict
        elif isinstance(v, (list, tuple)):
            t = list
        elif isinstance(v, (str, int, float)):
            continue
        if t is list:
            stack.extend((x, depth + 1) for x in v)
        elif t is dict:
            for k, x in v.items():
                if type(k) is not str and not (lenient and isinstance(k, str)):
                    return "bad_field", f"has a non-str key {short(k)}"
                stack.append((x, depth + 1))
        else:
            return "bad_field", f"holds a {type(v).__name__} ({short(v)}); only JSON-like values travel"
    return None


# ----------------------------------------------------------------------------------- control messages
_HELLO_KEYS = frozenset({"v", "kind", "ch", "state", "need", "idle", "ret_m", "ret_b"})
_STATUS_KEYS = frozenset({"v", "kind", "ch", "inc", "known", "closing", "cap_m", "cap_b", "max_msg",
                          "lim_m", "lim_b", "acks", "eos_ack"})
_SHM_PROBE_KEYS = frozenset({"pid", "fd", "key"})
MAX_FREED = 4096
_BUNDLE_KEYS = frozenset({"v", "kind", "parts"})


@dataclass
class Hello:
    """Producer link state, sent to the consumer (see module docstring)."""

    ch: str
    state: str = "open"
    need: int = 0
    idle: bool = False
    ret_m: int = 0
    ret_b: int = 0
    shm: dict | None = None
    mac: bytes | None = None
    inc: str | None = None

    def to_bytes(self) -> bytes:
        h = {"v": SCHEMA_VERSION, "kind": HELLO, "ch": self.ch, "state": self.state, "need": self.need,
             "idle": self.idle, "ret_m": self.ret_m, "ret_b": self.ret_b}
        if self.shm is not None:
            h["shm"] = self.shm
        if self.mac is not None:
            h["mac"] = self.mac
        if self.inc is not None:
            h["inc"] = self.inc
        return pack(h)

    @classmethod
    def from_header(cls, h: dict) -> "Hello":
        check_keys(h, _HELLO_KEYS, frozenset({"shm", "mac", "inc"}), where="hello")
        mac = h.get("mac")
        if mac is not None and (type(mac) is not bytes or len(mac) != MAC_BYTES):
            raise DecodeError("bad_field", f"hello mac must be {MAC_BYTES} bytes of bin")
        state = h["state"]
        if state not in HELLO_STATES:
            raise DecodeError("bad_field", f"hello state {short(state)} not in {HELLO_STATES}")
        shm = h.get("shm")
        if shm is not None:
            check_keys(shm, _SHM_PROBE_KEYS, where="hello shm")
            get_int(shm, "pid", 1)
            get_int(shm, "fd", 0)
            get_str(shm, "key", 64)
        return cls(ch=get_str(h, "ch", allow_empty=True), state=state, need=get_int(h, "need", 0),
                   idle=get_bool(h, "idle"), ret_m=get_int(h, "ret_m", 0), ret_b=get_int(h, "ret_b", 0), shm=shm,
                   mac=mac, inc=get_str(h, "inc") if "inc" in h else None)


@dataclass
class Status:
    """Consumer state for one producer link (see module docstring)."""

    ch: str
    inc: str
    known: bool = True
    closing: bool = False
    cap_m: int = 0
    cap_b: int = 0
    max_msg: int = 0
    lim_m: int = 0
    lim_b: int = 0
    acks: list = field(default_factory=list)
    eos_ack: bool = False
    shm_max: int = 0
    freed: list = field(default_factory=list)
    nonce: bytes | None = None

    def to_bytes(self) -> bytes:
        h = {"v": SCHEMA_VERSION, "kind": STATUS, "ch": self.ch, "inc": self.inc, "known": self.known,
             "closing": self.closing, "cap_m": self.cap_m, "cap_b": self.cap_b, "max_msg": self.max_msg,
             "lim_m": self.lim_m, "lim_b": self.lim_b, "acks": self.acks, "eos_ack": self.eos_ack}
        if self.shm_max or self.freed:
            h["shm_max"], h["freed"] = self.shm_max, self.freed
        if self.nonce is not None:
            h["nonce"] = self.nonce
        return pack(h)

    @classmethod
    def from_header(cls, h: dict) -> "Status":
        check_keys(h, _STATUS_KEYS, frozenset({"shm_max", "freed", "nonce"}), where="status")
        nonce = h.get("nonce")
        if nonce is not None and (type(nonce) is not bytes or len(nonce) != NONCE_BYTES):
            raise DecodeError("bad_field", f"status nonce must be {NONCE_BYTES} bytes of bin")
        acks = h["acks"]
        if type(acks) is not list:
            raise DecodeError("bad_field", "status acks must be a list of non-negative ints")
        for a in acks:  # one per acknowledged batch: a loop, not any(genexpr)
            if type(a) is not int or a < 0:
                raise DecodeError("bad_field", "status acks must be a list of non-negative ints")
        freed = h.get("freed", [])
        if type(freed) is not list or len(freed) > MAX_FREED or any(type(b) is not str for b in freed):
            raise DecodeError("bad_field", f"status freed must be a list of at most {MAX_FREED} block ids")
        return cls(ch=get_str(h, "ch", allow_empty=True), inc=get_str(h, "inc"), known=get_bool(h, "known"),
                   closing=get_bool(h, "closing"), cap_m=get_int(h, "cap_m", 1), cap_b=get_int(h, "cap_b", 1),
                   max_msg=get_int(h, "max_msg", 1), lim_m=get_int(h, "lim_m", 0), lim_b=get_int(h, "lim_b", 0),
                   acks=acks, eos_ack=get_bool(h, "eos_ack"),
                   shm_max=get_int(h, "shm_max", 0) if "shm_max" in h else 0, freed=freed, nonce=nonce)
