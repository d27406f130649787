"""tcp:// endpoints: loopback by default; other hosts only with `allow_remote` (and CURVE keys).

`tcp://127.0.0.1:0` (or no address) binds a free port; `bind` returns the address with the port.
"""

from __future__ import annotations

import ipaddress
import logging
import re

import zmq

from flowrl.transport.endpoints import Endpoint

log = logging.getLogger("flowrl.transport")
_TCP = re.compile(r"^tcp://(\[[^\]]+\]|[^:/]+):(\d+|\*)$")


def parse_tcp(address: str) -> tuple[str, str]:
    m = _TCP.match(address)
    if not m:
        raise ValueError(f"tcp address {address!r} is not tcp://HOST:PORT")
    return m.group(1).strip("[]"), m.group(2)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class TcpEndpoint(Endpoint):
    scheme = "tcp"

    def choose(self) -> str:
        return "tcp://127.0.0.1:*"

    def check_bind(self, address: str) -> str:
        host, port = parse_tcp(address)
        self._check_host(host, address, "binding")
        if port == "0":
            port = "*"
        return f"tcp://{host if ':' not in host else '[' + host + ']'}:{port}"

    def after_bind(self, sock, address: str) -> str:
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def check_connect(self, address: str) -> None:
        host, _ = parse_tcp(address)
        self._check_host(host, address, "connecting to")

    def _check_host(self, host: str, address: str, doing: str) -> None:
        if is_loopback(host):
            return
        if not self.config.allow_remote:
            raise ValueError(f"{doing} {address} leaves this host; channels stay on loopback unless "
                             "ChannelConfig(allow_remote=True) (with curve keys) says otherwise")
        if self.config.curve is None:
            log.warning("channel %s: %s %s without CURVE keys: traffic is neither encrypted nor "
                        "authenticated", self.name, doing, address)
