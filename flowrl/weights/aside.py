"""Blocking torch.distributed calls that must not hold their caller past a deadline or a fence.

Two of torch's blocking calls cannot be interrupted: a TCPStore client waiting for a listener that
accepted and never answers, and gloo retrying a member that died while a group formed. Such a call
runs `Aside`, on a thread of its own, and the caller waits as it chooses; the connections it opened
can be shut down under it (`tcp_links` before and after, `shut_down`), which ends its waits.

    before = tcp_links()[0]
    call = Aside(lambda: dist.TCPStore(...), "flowrl-store-connect")
    if not call.wait(timeout_s):
        shut_down(tcp_links()[0] - before)         # its read fails; its thread returns
    return call.result()                           # the value, or its error on this thread
"""

from __future__ import annotations

import socket
import threading
from typing import Any, Callable, Iterable

Link = tuple[int, tuple, tuple]  # (fd, (local ip, port), (remote ip, port))


class Aside:
    """`make()` on a daemon thread of its own."""

    def __init__(self, make: Callable[[], Any], name: str):
        self._out: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, args=(make,), name=name, daemon=True)
        self._thread.start()

    def _run(self, make: Callable[[], Any]) -> None:
        try:
            self._out["value"] = make()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread by result()
            self._out["error"] = e

    def wait(self, seconds: float) -> bool:
        """Whether the call returned within `seconds`."""
        self._thread.join(seconds)
        return not self._thread.is_alive()

    def result(self) -> Any:
        if "error" in self._out:
            raise self._out["error"]
        return self._out["value"]


def tcp_links() -> tuple[set[Link], set[int]]:
    """This process's connected TCP sockets and the ports it listens on."""
    import psutil

    links, listening = set(), set()
    for c in psutil.Process().net_connections(kind="tcp"):
        if c.raddr and c.fd >= 0:
            links.add((c.fd, tuple(c.laddr), tuple(c.raddr)))
        elif c.status == psutil.CONN_LISTEN:
            listening.add(c.laddr.port)
    return links, listening


def shut_down(links: Iterable[Link]) -> None:
    """Shut each connection down under whoever holds it (its reads and writes fail at once); a
    descriptor no longer connected as recorded (closed, its number reused) is left alone. The
    descriptors stay their holder's."""
    for fd, local, remote in links:
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if sock.getsockname()[:2] == local and sock.getpeername()[:2] == remote:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            sock.detach()
