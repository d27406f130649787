"""The control plane between the controller and node processes: one dataclass per message.

The controller binds one ROUTER socket; each node process connects a DEALER whose identity is
`node/replica/rank#incarnation` (its heartbeat thread: the same plus `#hb`). Batch payloads never
travel here, only small msgpack maps `{t: TYPE, k: SECRET?, ...fields}`. Every field is declared
with its type, containers included (`list[int]`, `dict[str, str]`); `decode` checks each one and
rejects unknown or missing fields with a `ControlError` naming the message and the field, so a
malformed message is dropped and counted, never a crash. Every message declares `k`, the run's
secret: nodes send it (checked by the controller), so a stray local process cannot speak for a
node. docs/recovery.md lists these messages; a test checks that table against the classes below.

    data = encode(Consumed(batch_id="t-000003", attempt=0, index=3, epoch=1), secret="ab12")
    msg = decode(data)          # -> Consumed(...), msg.k == "ab12"
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack

MAX_CONTROL_BYTES, MAX_STR = 1 << 20, 4096
INVALID = "invalid"  # a Duplicate's `why` for a batch refused at the node's boundary: "invalid on EDGE: PROBLEM"


class ControlError(ValueError):
    """A control message that is not one of ours (bad bytes, unknown type, wrong field types)."""


_TYPES: dict[str, type] = {}


def message(t: str, direction: str):
    """Register a message class under its wire name `t`; `direction` is for the docs table. Adds
    the declared field `k: str | None` (the run's secret; not part of equality) to every message."""

    def wrap(cls):
        cls.__annotations__ = {**cls.__dict__.get("__annotations__", {}), "k": "str | None"}
        cls.k = field(default=None, compare=False)
        cls = dataclass(frozen=True)(cls)
        cls.t, cls.direction = t, direction
        cls._names = tuple(f.name for f in dataclasses.fields(cls))
        _TYPES[t] = cls
        return cls

    return wrap


# node -> controller -----------------------------------------------------------------------------
@message("ready", "node -> controller")
class Ready:
    """Setup done and inputs bound: the controller may rely on this process."""

    pid: int
    store_port: int | None = None
    inputs: dict[str, str] | None = None  # input port -> the address it bound (a tcp port is chosen at bind)


@message("wired", "node -> controller")
class Wired:
    """Outputs connected; the process takes input now (in recovery epoch `epoch`)."""

    epoch: int = 0


@message("hb", "node -> controller")
class Heartbeat:
    """Alive. From the heartbeat thread: `busy` = [batch_id, seconds inside the current call] while
    the node is inside `process`/`generate`/`join`/a weight sync; from the event loop: metrics."""

    busy: list[str | float] | None = None
    metrics: dict[str, Any] | None = None  # checked by the metrics hub (flowrl/metrics/wire.py)


@message("consumed", "node -> controller")
class Consumed:
    """A sink consumed a ticket (`dropped_by` set: it received the ticket's drop marker)."""

    batch_id: str
    attempt: int
    index: int
    epoch: int
    policy_version: int = -1
    staleness: int = 0
    dropped_by: str | None = None
    metrics: dict[str, Any] | None = None


@message("published", "node -> controller")
class Published:
    """A trainer finished an update: weights `version` are ready to broadcast."""

    version: int
    epoch: int
    digest: str | None = None


@message("synced", "node -> controller")
class Synced:
    """A subscriber holds weights `version` (after weight-sync epoch `sync_epoch`)."""

    version: int
    sync_epoch: int
    digest: str | None = None


@message("sync_failed", "node -> controller")
class SyncFailed:
    """A weight broadcast failed or timed out; the previous version is still held. `permanent`:
    it cannot work in any epoch (the layouts differ)."""

    sync_epoch: int
    error: str
    permanent: bool = False


@message("checkpointed", "node -> controller")
class Checkpointed:
    """A stateful node saved its state as of watermark `step` (every ticket < step, none after)."""

    step: int
    epoch: int
    file: str
    version: int = 0
    sha256: str | None = None  # of the shard as saved (after the atomic rename)
    size: int | None = None  # bytes
    copy: str | None = None  # its second copy under `launcher.checkpoint_uri`, when made


@message("recovered", "node -> controller")
class Recovered:
    """The node entered recovery epoch `epoch` (stateful nodes: after loading the checkpoint)."""

    epoch: int


@message("duplicate", "node -> controller")
class Duplicate:
    """A batch was dropped at the node's input: a duplicate, a stale epoch or an invalid batch (INVALID)."""

    batch_id: str
    attempt: int
    why: str


@message("turn_ask", "node -> controller")
class TurnAsk:
    """A member of a take-turns group needs its devices for ticket `index` (-1: no ticket)."""

    index: int = -1


@message("turn_released", "node -> controller")
class TurnReleased:
    """The member slept (its memory released): its turn `turn` is over."""

    turn: int = 0


@message("error", "node -> controller")
class Error:
    """The node failed (it exits right after). `type`, `file`, `line`: the user's exception and
    the innermost frame of the node's own code; `batch_id`: the ticket it was working on."""

    where: str
    type: str
    message: str
    file: str | None = None
    line: int | None = None
    batch_id: str | None = None
    traceback: str = ""


# controller -> node -----------------------------------------------------------------------------
@message("wire", "controller -> node")
class Wire:
    """Every consumer is ready: connect the outputs, then take input. `routes`: edge -> the
    [address, CURVE server key or ""] of each consumer replica, as they bound them."""

    routes: dict[str, list[list[str]]] | None = None


@message("ticket", "controller -> node")
class TicketMsg:
    """Work for a source: `size` items at position `index` of the run's sequence."""

    batch_id: str
    index: int
    attempt: int
    min_policy_version: int
    size: int
    epoch: int


@message("sync", "controller -> node")
class Sync:
    """Join weight-sync epoch `sync_epoch` as `rank` of `world_size` and receive/send `version`."""

    sync_epoch: int
    version: int
    rank: int
    world_size: int
    store: list[str | int | None]  # [host, port] of the publisher's rendezvous store
    timeout_s: float
    handoff: bool = False  # every member on the publisher's device: the region's handle, not a broadcast


@message("epoch", "controller -> node")
class Epoch:
    """Enter recovery epoch `epoch`: drop every batch of an older epoch; stateful nodes load
    `checkpoint` (None: their state after setup) and continue from ticket `watermark`; sinks
    already consumed the tickets in `consumed`."""

    epoch: int
    watermark: int
    checkpoint: str | None = None
    consumed: list[int] = field(default_factory=list)


@message("progress", "controller -> node")
class Progress:
    """Every ticket below `complete_below` is consumed by every sink: caches may forget them. The
    run issues `steps` tickets (more than the graph's when tickets were replaced)."""

    complete_below: int
    steps: int


@message("connect", "controller -> node")
class Connect:
    """A replica of a consumer was added: send on `edge` to `address` too."""

    edge: str
    address: str
    key: str | None = None  # the replica's CURVE public key (tcp between hosts)


@message("disconnect", "controller -> node")
class Disconnect:
    """A replica of a consumer is being removed: stop sending to `address`; what it has not
    acknowledged goes to the other replicas."""

    edge: str
    address: str


@message("admit", "controller -> node")
class Admit:
    """Producers of input `port` (on other hosts) added or removed: admit or refuse their CURVE keys."""

    port: str
    add: list[str] | None = None
    remove: list[str] | None = None


@message("scale", "client -> controller")
class Scale:
    """`flowrl scale`: run `replicas` replicas of stateless node `node` from now on."""

    node: str
    replicas: int


@message("scaled", "controller -> client")
class Scaled:
    """The answer to `scale`: done, or why not (a placement finding, a stateful node...)."""

    ok: bool
    message: str


@message("turn_grant", "controller -> node")
class TurnGrant:
    """The devices are this member's: turn number `turn` (it wakes, then calls its node)."""

    turn: int


@message("turn_yield", "controller -> node")
class TurnYield:
    """Another member asked: release turn `turn` once the calls in progress end (sleep, then
    `turn_released`)."""

    turn: int


@message("stop", "controller -> node")
class Stop:
    """Finish and exit 0."""


# codec --------------------------------------------------------------------------------------------
def encode(msg, secret: str | None = None) -> bytes:
    """A message -> msgpack bytes; `secret` (else `msg.k`) travels as `k`, omitted when None."""
    body = {"t": msg.t}
    for name in msg._names:
        body[name] = getattr(msg, name)
    if secret is not None:
        body["k"] = secret
    elif body["k"] is None:
        del body["k"]
    return msgpack.packb(body, use_bin_type=True)


def decode(data: bytes):
    """bytes -> a message object (`.k`: the sender's secret or None). Raises ControlError."""
    if len(data) > MAX_CONTROL_BYTES:
        raise ControlError(f"control message of {len(data)} bytes exceeds {MAX_CONTROL_BYTES}")
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True, max_str_len=MAX_CONTROL_BYTES,
                               max_bin_len=0, max_array_len=1 << 16, max_map_len=1 << 16)
    except Exception as e:  # noqa: BLE001 - msgpack raises several types for bad bytes
        raise ControlError(f"not msgpack: {type(e).__name__}: {e}"[:200]) from None
    if type(body) is not dict or type(body.get("t")) is not str:
        raise ControlError("control message is not a map with a string field 't'")
    cls = _TYPES.get(body.pop("t"))
    if cls is None:
        raise ControlError("unknown control message type")
    schema = _schema(cls)
    unknown = set(body) - set(schema)
    if unknown:
        raise ControlError(f"{cls.t}: unknown fields {sorted(unknown)[:5]}")
    for name, (hint, fits, required) in schema.items():
        if name in body:
            if not fits(body[name]):
                raise ControlError(f"{cls.t}.{name}: expected {hint}, got {_describe(body[name])}")
        elif required:
            raise ControlError(f"{cls.t}: missing field {name!r}")
    return cls(**body)


def message_types() -> dict[str, type]:
    """Every registered message class by wire name (the docs table is checked against this)."""
    return dict(_TYPES)


# field checks: built once per class from its type hints ----------------------------------------------
_SCHEMAS: dict[type, dict[str, tuple[str, Callable[[object], bool], bool]]] = {}


def _schema(cls) -> dict:
    """field name -> (hint as written, check, required)."""
    if cls not in _SCHEMAS:  # every class at import (below): a bad hint fails there, not on a message
        hints = typing.get_type_hints(cls)
        _SCHEMAS[cls] = {f.name: (str(hints[f.name]).replace("typing.", ""), _check(hints[f.name], cls.t, f.name),
                                  f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                         for f in dataclasses.fields(cls)}
    return _SCHEMAS[cls]


def _str(value) -> bool:
    return type(value) is str and len(value) <= (1 << 16 if value.count("\n") else MAX_STR)


def _int(value) -> bool:
    return type(value) is int and -(1 << 62) <= value < 1 << 62


_SCALARS: dict[object, Callable[[object], bool]] = {
    int: _int, str: _str, float: lambda v: type(v) in (int, float), bool: lambda v: type(v) is bool,
    type(None): lambda v: v is None, Any: lambda v: True,
}


def _check(hint, t: str, name: str) -> Callable[[object], bool]:
    """A predicate for values of `hint`. Containers must say what they hold (`list[int]`, not
    `list`): a bare one is a programming error, raised when the class is first used."""
    if hint in _SCALARS:
        return _SCALARS[hint]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if isinstance(hint, types.UnionType) or origin is typing.Union:
        options = [_check(h, t, name) for h in args]
        return lambda v: any(ok(v) for ok in options)
    if origin is list and len(args) == 1:
        item = _check(args[0], t, name)
        return lambda v: type(v) is list and all(item(x) for x in v)
    if origin is dict and len(args) == 2:
        key, val = _check(args[0], t, name), _check(args[1], t, name)
        return lambda v: type(v) is dict and all(key(k) and val(x) for k, x in v.items())
    raise TypeError(f"message {t!r} field {name!r}: type {hint} is not supported on the wire; use int, float, "
                    "str, bool, None, Any or list[...] / dict[..., ...] of those")


def _describe(value) -> str:
    """What arrived, for the error: its type, and for a container the types it holds."""
    if type(value) is list:
        return f"list of {sorted({type(x).__name__ for x in value})[:4]}"
    if type(value) is dict:
        return f"dict of {sorted({f'{type(k).__name__}: {type(x).__name__}' for k, x in value.items()})[:4]}"
    if type(value) is str:
        return f"str of {len(value)} chars"
    return type(value).__name__


for _cls in _TYPES.values():
    _schema(_cls)
