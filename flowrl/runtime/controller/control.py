"""The controller's control socket and the file that tells `flowrl scale` where it is.

`ControlSocket` binds the ROUTER every node process (and `flowrl scale`) talks to, keeps the run's
secret and the private socket folder, and turns frames into messages: from a node process it
hands back `(proc, msg)` only for a current incarnation with the run's secret; a client's frames
(`client#...`) come back raw for the scale handler. Everything it drops is counted in `rejected`.

`ControlFile` is `RUN_DIR/control.json` (0600): the socket's address, the secret and the
controller's pid. `ControlFile.read` fails with a message naming the file when it is missing or
garbled.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import zmq

from flowrl.errors import FlowrlError
from flowrl.runtime.controller.procs import Proc, ProcTable
from flowrl.runtime.controller.wiring import make_sockdir
from flowrl.runtime.protocol import messages as m
from flowrl.runtime.protocol.addresses import Network, bind_control, release_control
from flowrl.runtime.protocol.checkpoints import write_json_atomic
from flowrl.transport.asyncsock import AsyncSocket

log = logging.getLogger("flowrl.controller")

CONTROL_FILE = "control.json"


class ControlFileError(FlowrlError):
    """RUN_DIR/control.json is missing or is not a control file."""


@dataclass(frozen=True)
class ControlFile:
    address: str
    secret: str
    pid: int

    def write(self, run_dir: Path) -> Path:
        """Written whole (a reader never sees half a file), readable by the run's user only."""
        path = Path(run_dir) / CONTROL_FILE
        write_json_atomic(path, asdict(self), mode=0o600)
        return path

    @classmethod
    def read(cls, run_dir: str | Path) -> "ControlFile":
        path = Path(run_dir) / CONTROL_FILE
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ControlFileError(f"{path} is missing or unreadable: is the run still going?") from None
        except OSError as e:
            raise ControlFileError(f"{path} is missing or unreadable ({e.strerror}): is it this user's run?") from None
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ControlFileError(f"{path} is garbled (not JSON: {e}); it is rewritten when the run starts") from None
        if not isinstance(data, dict):
            raise ControlFileError(f"{path} is garbled: a JSON object was expected, got {type(data).__name__}")
        problems = [f"{k!r} must be {t.__name__}" for k, t in (("address", str), ("secret", str), ("pid", int))
                    if not isinstance(data.get(k), t) or isinstance(data.get(k), bool)]
        if problems:
            raise ControlFileError(f"{path} is garbled: {'; '.join(problems)}")
        return cls(address=data["address"], secret=data["secret"], pid=data["pid"])


class ControlSocket:
    def __init__(self, net: Network, run_dir: Path):
        self.secret = secrets.token_hex(16)
        self.sockdir = make_sockdir()
        net.sockdir = str(self.sockdir)
        self.net = net
        self.zctx, router = bind_control(net)
        self.router = AsyncSocket(router)
        self.address = f"ipc://{self.sockdir}/control"
        self.file = ControlFile(address=self.address, secret=self.secret, pid=os.getpid()).write(run_dir)
        self.rejected = 0  # frames dropped: malformed, unauthenticated

    async def send(self, proc: Proc, msg) -> bool:
        try:
            await self.router.send_multipart([proc.identity, m.encode(msg)])
            return True
        except zmq.ZMQError:  # not connected (yet, or any more): the caller retries or replays
            return False

    async def reply(self, identity: bytes, msg) -> None:
        try:
            await self.router.send_multipart([identity, m.encode(msg)])
        except zmq.ZMQError:
            pass

    async def readable(self, timeout_s: float) -> bool:
        """Whether a message is waiting, or comes within `timeout_s`."""
        return await self.router.poll(timeout_s)

    async def receive(self, procs: ProcTable):
        """One frame set: ("node", proc, msg), ("client", identity, data) or None (dropped)."""
        frames = await self.router.recv_multipart()
        if len(frames) != 2:
            self.rejected += 1
            return None
        identity, data = frames
        if identity.startswith(b"client#"):
            return "client", identity, data
        proc, current = procs.by_identity(identity)
        if proc is None or not current:
            return None  # a stranger, or an old incarnation's last words
        try:
            msg = m.decode(data)
        except m.ControlError as e:
            self.rejected += 1
            log.warning("bad control message from %s: %s", proc.id, e)
            return None
        if not self.authentic(msg):
            self.rejected += 1
            log.warning("control message for %s without the run's secret: dropped", proc.id)
            return None
        return "node", proc, msg

    def client_request(self, data: bytes):
        """A client's request with the run's secret, or None (counted as rejected)."""
        try:
            msg = m.decode(data)
        except m.ControlError:
            self.rejected += 1
            return None
        if not isinstance(msg, m.Scale) or not self.authentic(msg):
            self.rejected += 1
            return None
        return msg

    def authentic(self, msg) -> bool:
        return hmac.compare_digest(msg.k or "", self.secret)

    def close(self) -> None:
        self.file.unlink(missing_ok=True)
        self.router.close(linger=0)
        release_control(self.net, self.zctx)
        shutil.rmtree(self.sockdir, ignore_errors=True)
