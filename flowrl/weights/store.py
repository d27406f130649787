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

Waits: a store made with `stop` (`ours.child("epoch-3/pg", stop=..., timeout_s=30)`, what the
publisher and subscribers hand gloo to form an epoch's group) waits in `wait_until`: each
`wait`/`get` of a missing key ends when the key appears, when `stop()` gives a reason (the epoch
was fenced: a newer one is ordered; heard within FIRST_WAIT_S), or at its timeout, with a
WeightSyncError that names the key. Without `stop`, `wait`/`get` block as TCPStore does, up to
its timeout.

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
import time
from typing import Any, Callable

import torch.distributed as dist

from flowrl.weights.errors import StoreAuthError, WeightSyncError

ALL_INTERFACES = {"", "0.0.0.0", "::", "*"}
Stop = Callable[[], "str | None"] | None  # a reason to stop waiting (the epoch was fenced), or None
POLL_MIN_S, POLL_MAX_S = 0.002, 0.05  # a polling wait checks its key (and `stop`) this often: 2 ms growing to 50 ms
FIRST_WAIT_S = 0.25  # ...after blocking on the store this long first
CONNECT_SLICE_S = 0.05  # how soon a connecting client hears its `stop` (see `client`)
DEFAULT_TIMEOUT_S = 60.0  # a store's waits without a timeout of their own (TCPStore's, and a polling one's)


def wait_until(ready: Callable[[], bool], deadline: float, stop: Stop = None,
               block: Callable[[float], bool] | None = None) -> bool:
    """Wait until `ready()` (True) or `deadline`, a time.monotonic() (False); raise WeightSyncError
    as soon as `stop()` gives a reason.

    With `block(seconds)` (a blocking store wait on the same key, see `blocking`) the first
    FIRST_WAIT_S block: a key set meanwhile (or already) ends the wait at once, and that is the
    answer, with no `ready()` round trip to the store before or after it (a round's usual case: no
    added latency); `stop` is heard within FIRST_WAIT_S. Then it polls `ready()`, 2 ms growing to
    50 ms apart: `stop` is heard within POLL_MAX_S, and a long wait (a member busy in a batch) makes
    c10d log one timed-out-wait warning, not two every FIRST_WAIT_S."""
    reason = stop() if stop is not None else None
    if reason:
        raise WeightSyncError(reason)
    if block is not None:
        left = min(FIRST_WAIT_S, deadline - time.monotonic())
        if left > 0 and block(left):
            return True
    delay = POLL_MIN_S
    while True:
        reason = stop() if stop is not None else None
        if reason:
            raise WeightSyncError(reason)
        if ready():
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(delay, left))
        delay = min(2 * delay, POLL_MAX_S)


def blocking(store: Any, keys: list[str]) -> Callable[[float], bool]:
    """`block` for `wait_until`: `store.wait(keys)` for at most that many seconds; True once every
    key is there, False at its timeout (quiet)."""
    def block(seconds: float) -> bool:
        try:
            store.wait(keys, datetime.timedelta(seconds=seconds))
        except Exception:  # noqa: BLE001 - a timeout; a broken store raises in the caller's next check
            return False
        return True
    return block


class WeightStore:
    """A TCPStore server that listens on `host` only; `.port` tells which port it got."""

    def __init__(self, host: str = "127.0.0.1", *, port: int = 0, timeout_s: float = DEFAULT_TIMEOUT_S):
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


def connect(address: tuple[str, int], secret: bytes | str, timeout_s: float = 30.0, *,
            stop: Stop = None) -> "SealedStore":
    """A subscriber's client of the publisher's store (a rank's of its rank 0's)."""
    return SealedStore(client(address, timeout_s, stop=stop), secret)


def client(address: tuple[str, int], timeout_s: float = 30.0, *, stop: Stop = None) -> Any:
    """A TCPStore client of the store at `address`, or an error within about `timeout_s`; with
    `stop`, a WeightSyncError within CONNECT_SLICE_S of `stop()` giving a reason.

    torch's client retries a refused connection until its timeout, but once a listener accepts, it
    waits for the answer to its first message without one: something else listening on that port,
    or a middlebox that passes connections and drops their data, would hold it for good. So it is
    made aside; past the deadline the connection it opened is shut down (it then fails) and this raises.
    A refused connection is also what a store whose process died gives: an order of an epoch formed
    just before the controller heard of that death names it, and the epoch the recovery forms
    next fences this wait (`stop`) instead of leaving the subscriber there for the whole timeout."""
    from flowrl.weights.aside import Aside, shut_down, tcp_links

    host, port = address[0], int(address[1])
    before = tcp_links()[0]  # a client already connected there is not this one
    call = Aside(lambda: dist.TCPStore(host, port, None, is_master=False,
                                       timeout=datetime.timedelta(seconds=timeout_s)), "flowrl-store-connect")
    deadline = time.monotonic() + timeout_s + 1.0
    while not call.wait(max(0.0, min(CONNECT_SLICE_S, deadline - time.monotonic()))):
        why = stop() if stop is not None else None
        if why:  # the attempt is left to its thread: it ends at its own timeout, its client unused
            raise WeightSyncError(f"left while connecting to the weight store at {host}:{port}: {why}")
        if time.monotonic() < deadline:
            continue
        want = host.removeprefix("::ffff:")
        shut_down(x for x in tcp_links()[0] - before if x[2][1] == port and x[2][0].removeprefix("::ffff:") == want)
        call.wait(5.0)
        raise TimeoutError(f"the store at {host}:{port} accepted the connection but did not answer within "
                           f"{timeout_s:.0f} s (something else listening on that port, or a firewall that passes "
                           "connections and drops their data)")
    return call.result()


def _derive(secret: bytes, label: bytes) -> bytes:
    return hmac.new(secret, b"flowrl weight store v1 " + label, hashlib.sha256).digest()


class SealedStore(dist.Store):
    """A dist.Store over `inner` whose keys are HMACs and whose values are sealed by `secret`."""

    NONCE, TAG = 16, 32

    def __init__(self, inner: Any, secret: bytes | str, prefix: str = "", *, stop: Stop = None,
                 timeout_s: float | None = None):
        super().__init__()
        if isinstance(secret, str):
            secret = secret.encode()
        if len(secret) < 16:
            raise ValueError(f"the weight-store secret has {len(secret)} bytes; use at least 16 random bytes "
                             "(e.g. secrets.token_bytes(32), handed out by the controller)")
        self.inner, self.secret, self.prefix = inner, secret, prefix
        self.stop, self.timeout_s = stop, timeout_s
        self._names, self._enc, self._mac = (_derive(secret, x) for x in (b"names", b"enc", b"mac"))

    def child(self, prefix: str, *, stop: Stop = None, timeout_s: float | None = None) -> "SealedStore":
        """The same store with every key under `prefix/` (one per epoch, one per round). With
        `stop`, its waits (`wait_until`) end when `stop()` gives a reason or after `timeout_s` (the
        timeout a caller such as gloo passes to `wait` counts when smaller)."""
        return SealedStore(self.inner, self.secret, f"{self.prefix}{prefix}/", stop=stop or self.stop,
                           timeout_s=timeout_s if timeout_s is not None else self.timeout_s)

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
        if self.stop is not None:
            self.wait([key])  # a missing key: wait as `wait` does (stop, deadline), not as TCPStore's get
        return self.open(k, bytes(self.inner.get(k)), name=key)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        mapped = [self._key(k) for k in keys]
        if self.stop is None:
            if timeout is None:
                self.inner.wait(mapped)
            else:
                self.inner.wait(mapped, timeout)
            return
        limits = [x for x in (self.timeout_s, timeout.total_seconds() if timeout is not None else None) if x]
        seconds = min(limits) if limits else DEFAULT_TIMEOUT_S
        if not wait_until(lambda: self.inner.check(mapped), time.monotonic() + seconds, self.stop,
                          block=blocking(self.inner, mapped)):
            raise WeightSyncError(f"weight store: no value for {', '.join(self.prefix + k for k in keys)} within "
                                  f"{seconds:.1f} s (a member of the epoch did not get there)")

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
