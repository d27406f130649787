"""What LocalLauncher and its fork server say to each other: one JSON object per line.

    launcher -> server   StartRequest  {"spec": PATH, "log": PATH}
    server -> launcher   Started       {"pid": PID}                  the reply to a request, in order
                         Refused       {"refused": WHY}              the reply to a request it could not read
                         Exited        {"exit": PID, "code": CODE}   CODE < 0: killed by signal -CODE

    line = encode(StartRequest(spec="/run/specs/actor.json", log="/run/logs/actor.log"))
    decode_request(line)     # -> StartRequest(...); a garbled line raises ForkProtocolError
    decode_reply(b'{"pid": 42}\n')   # -> Started(pid=42)
"""

from __future__ import annotations

import json
from dataclasses import dataclass


class ForkProtocolError(ValueError):
    """A line that is not one of the messages above (the error says which line and why)."""


@dataclass(frozen=True)
class StartRequest:
    """Fork a node process that runs the entry module on process spec `spec`, logging to `log`."""

    spec: str
    log: str


@dataclass(frozen=True)
class Started:
    pid: int


@dataclass(frozen=True)
class Refused:
    """A request the server could not read: nothing was started."""

    why: str


@dataclass(frozen=True)
class Exited:
    pid: int
    code: int


def encode(msg: StartRequest | Started | Refused | Exited) -> bytes:
    """One message as one JSON line."""
    if isinstance(msg, StartRequest):
        body = {"spec": msg.spec, "log": msg.log}
    elif isinstance(msg, Started):
        body = {"pid": msg.pid}
    elif isinstance(msg, Refused):
        body = {"refused": msg.why}
    else:
        body = {"exit": msg.pid, "code": msg.code}
    return (json.dumps(body) + "\n").encode()


def _object(line: bytes) -> dict:
    try:
        body = json.loads(line)
    except ValueError as e:
        raise ForkProtocolError(f"fork-server line {line[:120]!r} is not JSON: {e}") from None
    if type(body) is not dict:
        raise ForkProtocolError(f"fork-server line {line[:120]!r} is not a JSON object")
    return body


def _fields(line: bytes, body: dict, kind: type, **types: type) -> dict:
    if set(body) != set(types) or any(type(body[k]) is not t for k, t in types.items()):
        shown = ", ".join(f"{k}: {t.__name__}" for k, t in types.items())
        raise ForkProtocolError(f"fork-server line {line[:120]!r}: a {kind.__name__} needs exactly {{{shown}}}")
    return body


def decode_request(line: bytes) -> StartRequest:
    """A launcher's line -> StartRequest. Raises ForkProtocolError."""
    body = _fields(line, _object(line), StartRequest, spec=str, log=str)
    return StartRequest(spec=body["spec"], log=body["log"])


def decode_reply(line: bytes) -> Started | Refused | Exited:
    """A server's line -> Started, Refused or Exited. Raises ForkProtocolError."""
    body = _object(line)
    if "exit" in body:
        body = _fields(line, body, Exited, exit=int, code=int)
        return Exited(pid=body["exit"], code=body["code"])
    if "refused" in body:
        return Refused(why=_fields(line, body, Refused, refused=str)["refused"])
    return Started(pid=_fields(line, body, Started, pid=int)["pid"])
