"""Addresses of a channel: one `Endpoint` class per transport kind, chosen by the address scheme.

    ep = endpoint_for("ipc", config, name="rollout->reward")   # pick.py; or an address: "tcp://127.0.0.1:0"
    address = ep.bind(sock, None)                              # binds; returns the real address
    ep.check_connect("tcp://10.0.0.2:5555")                    # policy checks before a connect
    await ep.cleanup()                                         # after the socket is closed

The backends differ only in how an address is chosen, checked and cleaned up; the channel protocol
on top is the same for all of them.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from flowrl.transport.config import ChannelConfig

SCHEMES = ("ipc", "tcp", "inproc")


def scheme_of(address: str) -> str:
    m = re.match(r"^([a-z]+)://.+", address or "")
    if not m or m.group(1) not in SCHEMES:
        raise ValueError(f"address {address!r} is not ipc://PATH, tcp://HOST:PORT or inproc://NAME")
    return m.group(1)


def safe_name(name: str, max_chars: int = 40) -> str:
    """A channel name as a file / endpoint name: `rollout->reward` -> `rollout-_reward`."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:max_chars] or "channel"


class Endpoint:
    """Base: how one transport kind chooses, checks, binds and cleans up addresses."""

    scheme: ClassVar[str] = ""

    def __init__(self, config: ChannelConfig, name: str):
        self.config, self.name = config, name

    def choose(self) -> str:
        """A fresh address to bind when the caller gave none."""
        raise NotImplementedError

    def check_bind(self, address: str) -> str:
        """Policy checks before binding `address`; returns the address to hand to zmq."""
        return address

    def check_connect(self, address: str) -> None:
        """Policy checks before a producer connects to `address`."""

    def bind(self, sock: Any, address: str | None) -> str:
        target = self.check_bind(address or self.choose())
        sock.bind(target)
        return self.after_bind(sock, target)

    def after_bind(self, sock: Any, address: str) -> str:
        return address

    async def cleanup(self) -> None:
        """Remove what `choose` / `bind` created (after the socket is closed)."""
