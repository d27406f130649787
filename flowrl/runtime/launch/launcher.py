"""Launchers start node processes; the worker code does not care which one did.

`local` (default): processes on this host, forked from a fork server (`forkserver.py`) that has
already imported the worker and what the run's nodes preload (torch unless they say otherwise), so
a restarted node is running in well under the ~1.5 s a fresh `import torch` costs. `subprocess`:
plain `python -m flowrl.runtime.worker` (no preloading).
`ray`: each node process under a Ray actor on its planned host (`ray_launcher.py`).

Every handle is ended by PID: SIGTERM, a bounded wait, SIGKILL.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

from flowrl.runtime.launch.child import die_with_parent
from flowrl.runtime.protocol.forkserver import (Exited, ForkProtocolError, Refused, StartRequest, decode_reply,
                                                encode)
from flowrl.runtime.protocol.procspec import WORKER_MODULE

log = logging.getLogger("flowrl.launcher")


class ProcessHandle(ABC):
    pid: int

    @abstractmethod
    def poll(self) -> int | None:
        """Exit code (negative: killed by that signal), or None while running."""

    def signal(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def release(self) -> None:
        """Free what the launcher holds for this process once it is replaced (a Ray actor and its
        resources: `RayProcessHandle`); a local process holds nothing once it exited."""

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM (SIGCONT first, in case it is stopped), wait, then SIGKILL."""
        if self.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while self.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
        if self.poll() is None:
            self.signal(signal.SIGKILL)
            deadline = time.monotonic() + 5
            while self.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
        return self.poll()


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class Launcher(ABC):
    @abstractmethod
    def start(self, spec_path: Path, log_path: Path) -> ProcessHandle: ...

    def close(self) -> None:
        pass

    def fetch_checkpoint(self, *, src_host: str | None, src: str, dst_host: str | None, dst: str, sha256: str,
                         size: int | None = None) -> str:
        """Make `dst` on `dst_host` a copy of the checkpoint shard `src` on `src_host`, its sha256
        checked: "present" (it was there already) or "fetched". One machine: a local copy. Raises
        CheckpointError saying what went wrong (controller/shards.py names the holder and the fix)."""
        import shutil

        from flowrl.runtime.protocol.checkpoints import CheckpointError, file_digest

        if Path(dst).exists() and file_digest(Path(dst))[0] == sha256:
            return "present"
        if not Path(src).exists():
            raise CheckpointError(f"the file is not there ({src} is missing)")
        Path(dst).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{dst}.fetch{os.getpid()}.tmp")
        shutil.copyfile(src, tmp)
        got = file_digest(tmp)[0]
        if got != sha256:
            tmp.unlink(missing_ok=True)
            raise CheckpointError(f"its bytes have sha256 {got}, not the committed {sha256} (changed since the commit)")
        os.replace(tmp, dst)
        return "fetched"

    def prune_checkpoints(self, host: str | None, root: str, keep: list[int], newest: int) -> None:
        """Drop the checkpoint steps under `root` on `host` that the run no longer keeps (a host
        folder of `launcher.host_dirs`, or `checkpoint_uri`). One machine: here."""
        from flowrl.runtime.launch.ray_actor import prune_steps

        prune_steps(root, keep, newest)

    # where processes run (flowrl/runtime/protocol/addresses.py decides links from these) ---------------
    def host_address(self, host: str | None) -> str:
        """The cluster address of a plan host: what its processes bind. One machine: loopback."""
        return "127.0.0.1"

    def controller_address(self) -> str:
        """The cluster address of the controller's own host."""
        return "127.0.0.1"

    def free_port(self, address: str) -> int:
        """A TCP port free now on `address` (a host's cluster address), for a socket a process there
        binds at start and its peers are told before (a group's MASTER_PORT, a shard channel)."""
        from flowrl.runtime.protocol.addresses import free_port

        return free_port(address)

    def is_lost(self, host: str | None) -> bool:
        """True when `host` has left the cluster (its processes must move: flowrl/runtime/controller/replan.py)."""
        return False

    def is_remote(self, host: str | None) -> bool:
        """True when `host` is another machine than the controller's (processes that stop beating
        together there may have lost their machine; here, more likely the controller stalled)."""
        return False

    def inventory(self):
        """The hosts that are there now, as a placement Inventory (for a re-plan)."""
        raise NotImplementedError(f"{type(self).__name__} cannot re-plan")


class _ForkedHandle(ProcessHandle):
    def __init__(self, pid: int, server: "LocalLauncher"):
        self.pid = pid
        self.server = server

    def poll(self) -> int | None:
        return self.server.exit_codes.get(self.pid)


class LocalLauncher(Launcher):
    """Node processes forked from `flowrl.runtime.launch.forkserver`, which has imported `preload`
    already (default: `flowrl.Node.preload`'s, torch and torch._dynamo).

    The server dies with the controller (and its children with it), so a `kill -9` of the
    controller leaves nothing behind."""

    def __init__(self, start_timeout_s: float = 120.0, entry: str = WORKER_MODULE,
                 preload: Sequence[str] | None = None):
        import queue
        import threading

        if preload is None:
            from flowrl.node import Node

            preload = Node.preload
        self.start_timeout_s, self.entry = start_timeout_s, entry
        self.exit_codes: dict[int, int] = {}
        self.replies: queue.Queue = queue.Queue()
        self.server = subprocess.Popen([sys.executable, "-m", "flowrl.runtime.launch.forkserver", entry, *preload],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self.reader = threading.Thread(target=self._read, daemon=True, name="flowrl-forkserver-reader")
        self.reader.start()

    def _read(self) -> None:
        """The reader thread: exit codes into `exit_codes`, replies to requests into `replies`. A
        garbled line is logged and skipped: this thread must outlive anything the server writes."""
        for line in self.server.stdout:
            try:
                msg = decode_reply(line)
            except ForkProtocolError as e:
                log.warning("%s: skipped", e)
                continue
            if isinstance(msg, Exited):
                self.exit_codes[msg.pid] = msg.code
            else:
                self.replies.put(msg)
        self.replies.put(None)  # the server is gone

    def start(self, spec_path: Path, log_path: Path) -> ProcessHandle:
        import queue

        if self.server.poll() is not None:
            raise RuntimeError(f"the fork server exited ({describe_exit(self.server.returncode)}); "
                               "run with launcher: {type: subprocess} to see why")
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)  # a host folder (launcher.host_dirs) is here
        self.server.stdin.write(encode(StartRequest(spec=str(spec_path), log=str(log_path))))
        self.server.stdin.flush()
        try:
            reply = self.replies.get(timeout=self.start_timeout_s)
        except queue.Empty:
            raise RuntimeError(f"the fork server did not start a process within {self.start_timeout_s} s") from None
        if reply is None:
            raise RuntimeError("the fork server exited; run with launcher: {type: subprocess} to see why")
        if isinstance(reply, Refused):
            raise RuntimeError(f"the fork server refused to start {spec_path}: {reply.why}")
        return _ForkedHandle(reply.pid, self)

    def close(self) -> None:
        if self.server.poll() is None:
            try:
                self.server.stdin.close()  # the server kills what is left and exits
            except OSError:
                pass
            try:
                self.server.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()


# ---------------------------------------------------------------------------------------------
class _PopenHandle(ProcessHandle):
    def __init__(self, popen: subprocess.Popen):
        self.popen = popen
        self.pid = popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()


class SubprocessLauncher(Launcher):
    """A fresh interpreter per node process (slower start, nothing shared)."""

    def __init__(self, entry: str = WORKER_MODULE):
        self.entry = entry

    def start(self, spec_path: Path, log_path: Path) -> ProcessHandle:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)  # a host folder (launcher.host_dirs) is here
        log = open(log_path, "ab")
        try:
            popen = subprocess.Popen([sys.executable, "-m", self.entry, str(spec_path)],
                                     stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=die_with_parent)
        finally:
            log.close()
        return _PopenHandle(popen)
