"""The publisher's rendezvous store: bound to one address, every key and value sealed by the secret.

    server = WeightStore("127.0.0.1")                 # the publisher; never 0.0.0.0
    ours = server.sealed(secret)                      # a dist.Store: what gloo and we use
    theirs = connect(("127.0.0.1", server.port), secret, timeout_s=30)   # a subscriber

torch's TCPStore has no authentication: any process that reaches the port may list, read, write
and delete keys. So:

- The server listens on the given address only (we bind the socket and hand TCPStore its fd):
  the local launcher passes loopback, a multi-host run the publisher's cluster address.
- `SealedStore` wraps the client. Key names are HMAC-SHA256(secret, name): a client without the
  secret sees opaque names it cannot map to meanings. Values are encrypted and authenticated
  (encrypt-then-MAC with stdlib primitives: SHAKE-256 keystream under a fresh 16-byte nonce,
  HMAC-SHA256 over key, nonce and ciphertext): it reads noise, and whatever it writes fails
  authentication (`StoreAuthError`) instead of being acted on. gloo's own rendezvous (the
  addresses of its pair sockets) goes through the same wrapper.

What is NOT protected: a client that reaches the port can still delete or overwrite sealed
values (the sync then fails with StoreAuthError or a timeout: denial of service, never wrong
weights from the store), see how many keys exist, and connect to gloo's data sockets, which
carry the weights unencrypted and listen on the same address. Across hosts, keep the cluster
network private (the same trust boundary as NCCL).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import socket
from typing import Any

import torch.distributed as dist

from flowrl.weights.errors import StoreAuthError

ALL_INTERFACES = {"", "0.0.0.0", "::", "*"}


class WeightStore:
    """A TCPStore server that listens on `host` only; `.port` tells which port it got."""

    def __init__(self, host: str = "127.0.0.1", *, port: int = 0, timeout_s: float = 60.0):
        if host in ALL_INTERFACES:
            raise ValueError(f"the weight store must bind to one address, not {host!r} (all interfaces): "
                             "pass 127.0.0.1 for a single host, or this host's cluster address")
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(512)
            self.host, self.port = host, sock.getsockname()[1]
            self.server = dist.TCPStore(host, self.port, None, is_master=True, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=sock.fileno())
        except Exception:
            sock.close()
            raise
        sock.detach()  # the fd is the server's now: a closed (collected) Python socket would close it under it

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def sealed(self, secret: bytes | str) -> "SealedStore":
        return SealedStore(self.server, secret)

    def close(self) -> None:
        self.server = None  # the server thread stops when the last reference goes


def connect(address: tuple[str, int], secret: bytes | str, timeout_s: float = 30.0) -> "SealedStore":
    """A subscriber's client of the publisher's store."""
    client = dist.TCPStore(address[0], int(address[1]), None, is_master=False,
                           timeout=datetime.timedelta(seconds=timeout_s))
    return SealedStore(client, secret)


def _derive(secret: bytes, label: bytes) -> bytes:
    return hmac.new(secret, b"flowrl weight store v1 " + label, hashlib.sha256).digest()


class SealedStore(dist.Store):
    """A dist.Store over `inner` whose keys are HMACs and whose values are sealed by `secret`."""

    NONCE, TAG = 16, 32

    def __init__(self, inner: Any, secret: bytes | str, prefix: str = ""):
        super().__init__()
        if isinstance(secret, str):
            secret = secret.encode()
        if len(secret) < 16:
            raise ValueError(f"the weight-store secret has {len(secret)} bytes; use at least 16 random bytes "
                             "(e.g. secrets.token_bytes(32), handed out by the controller)")
        self.inner, self.secret, self.prefix = inner, secret, prefix
        self._names, self._enc, self._mac = (_derive(secret, x) for x in (b"names", b"enc", b"mac"))

    def child(self, prefix: str) -> "SealedStore":
        """The same store with every key under `prefix/` (one per epoch, one per round)."""
        return SealedStore(self.inner, self.secret, f"{self.prefix}{prefix}/")

    def _key(self, key: str) -> str:
        return "fw/" + hmac.new(self._names, (self.prefix + key).encode(), hashlib.sha256).hexdigest()[:40]

    def _stream(self, nonce: bytes, n: int) -> bytes:
        return hashlib.shake_256(self._enc + nonce).digest(n)

    def seal(self, key: str, value: bytes) -> bytes:
        nonce = os.urandom(self.NONCE)
        ct = self._xor(value, self._stream(nonce, len(value)))
        return nonce + ct + hmac.new(self._mac, key.encode() + nonce + ct, hashlib.sha256).digest()

    def open(self, key: str, raw: bytes, name: str = "") -> bytes:
        nonce, ct, tag = raw[:self.NONCE], raw[self.NONCE:-self.TAG], raw[-self.TAG:]
        want = hmac.new(self._mac, key.encode() + nonce + ct, hashlib.sha256).digest()
        if len(raw) < self.NONCE + self.TAG or not hmac.compare_digest(tag, want):
            raise StoreAuthError(f"weight-store key {self.prefix}{name or key} holds a value not written with this run's "
                                 "secret (tampered, or written by a client without it); the sync is refused")
        return self._xor(ct, self._stream(nonce, len(ct)))

    @staticmethod
    def _xor(a: bytes, b: bytes) -> bytes:
        return (int.from_bytes(a, "little") ^ int.from_bytes(b, "little")).to_bytes(len(a), "little")

    # dist.Store ------------------------------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        if isinstance(value, str):
            value = value.encode()
        k = self._key(key)
        self.inner.set(k, self.seal(k, bytes(value)))

    def get(self, key: str) -> bytes:
        k = self._key(key)
        return self.open(k, bytes(self.inner.get(k)), name=key)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        mapped = [self._key(k) for k in keys]
        if timeout is None:
            self.inner.wait(mapped)
        else:
            self.inner.wait(mapped, timeout)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check([self._key(k) for k in keys])

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(self._key(key))

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.inner.set_timeout(timeout)

    def add(self, key: str, amount: int) -> int:
        raise NotImplementedError("SealedStore has no counters: a counter cannot be sealed")
