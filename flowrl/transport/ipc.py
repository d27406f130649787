"""ipc:// endpoints: a unix socket file in a private (0700) folder, owner-only (0600) itself.

A consumer restarted after a crash binds the same path again: the stale socket file of the dead
process is replaced. A path that a live process still serves is refused (ZeroMQ alone would
silently take it over and split the traffic). ZeroMQ does not remove socket files on close; a
receiver that closes removes its own.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import socket
import stat
import tempfile
import uuid

from flowrl.transport.endpoints import Endpoint, safe_name
from flowrl.transport.errors import AddressInUse

log = logging.getLogger("flowrl.transport")
MAX_PATH = 100  # sun_path holds 108 bytes; keep a margin


class IpcEndpoint(Endpoint):
    scheme = "ipc"

    def __init__(self, config, name):
        super().__init__(config, name)
        self._made_dir: str | None = None
        self._path: str | None = None
        self._inode = -1

    def choose(self) -> str:
        self._made_dir = tempfile.mkdtemp(prefix="flowrl-", dir=self.config.ipc_dir)  # mode 0700
        return f"ipc://{self._made_dir}/{safe_name(self.name)}-{uuid.uuid4().hex[:6]}"

    def check_bind(self, address: str) -> str:
        path = address[len("ipc://"):]
        if len(path.encode()) > MAX_PATH:
            raise ValueError(f"ipc path {path!r} is {len(path.encode())} bytes; unix sockets allow about "
                             f"{MAX_PATH}: use a shorter ipc_dir or channel name")
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            os.makedirs(parent, mode=0o700, exist_ok=True)
        elif os.stat(parent).st_mode & 0o077 and parent != self._made_dir:
            log.warning("ipc socket folder %s can be entered by other users (mode %o); prefer a 0700 folder",
                        parent, stat.S_IMODE(os.stat(parent).st_mode))
        if os.path.lexists(path):
            self._refuse_if_live(path)
        self._path = path
        return address

    def after_bind(self, sock, address: str) -> str:
        os.chmod(self._path, 0o600)
        self._inode = os.lstat(self._path).st_ino
        return address

    async def cleanup(self) -> None:
        """Remove our socket file (ZeroMQ leaves it) unless a newer process has bound the path since;
        remove the folder if we made it."""
        with contextlib.suppress(OSError):
            if self._path and os.lstat(self._path).st_ino == self._inode:
                os.unlink(self._path)
        if self._made_dir:
            shutil.rmtree(self._made_dir, ignore_errors=True)
            self._made_dir = None

    @staticmethod
    def _refuse_if_live(path: str) -> None:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise ValueError(f"ipc path {path} exists and is not a socket; choose another address")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError as e:
            if e.errno in (errno.ECONNREFUSED, errno.ENOENT):
                return  # stale file of a dead process: zmq replaces it
            raise
        finally:
            probe.close()
        raise AddressInUse(f"ipc address ipc://{path} is served by a live process; a second consumer "
                           "cannot bind it (stop the other one or choose another address)")
