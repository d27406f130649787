"""The Ray actor that holds one node process: it starts `python -m flowrl.runtime.worker SPEC` on its
host, reports its exit status, and forwards signals to it. Standard library only: Ray ships this
class to its workers by value, so a cluster node needs flowrl only for the node process itself.

Why a child process and not the worker inside the actor: the node process must be killable by PID
(`kill -9`, the supervisor's SIGTERM/SIGKILL, `--fault`), report a real exit status, and own its
signals and stdio, none of which a Ray worker process gives up. The actor is the child's parent:

- the child asks the kernel for SIGKILL when its parent *thread* dies (PR_SET_PDEATHSIG), so it is
  started from a thread that lives until the child exits, and dies with the actor (kill -9 of the
  actor, `ray.kill`, its Ray node going away, the controller's driver exiting);
- the node's heartbeat thread also exits the process when its parent changes;
- `wait()` returns the child's status (negative: killed by that signal); it runs concurrently
  with `signal()` (the actor is threaded).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        except OSError:
            pass


class FlowrlNodeProcess:
    """One node process under Ray (its process title reads `ray::FlowrlNodeProcess`)."""

    def __init__(self):
        self.popen: subprocess.Popen | None = None
        self.code: int | None = None
        self.error: str | None = None
        self.started = threading.Event()
        self.exited = threading.Event()

    def start(self, argv: list[str], log_path: str, env: dict[str, str], cwd: str | None = None,
              stdin: str | None = None) -> int:
        """Start the child (in `cwd` when this host has it), `stdin` written to its standard input
        (its ProcSpec: keys that must not be written to a file here); returns its PID on this host."""

        child_env = {**os.environ, **env}
        if env.get("FLOWRL_RAY_GPUS") == "1":  # the GPUs Ray gave this actor: the node process uses those
            child_env["FLOWRL_RAY_CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "")

        def run() -> None:
            try:
                os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)  # its host's folder (host_dirs)
                with open(log_path, "ab") as log:
                    self.popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                  stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                                                  env=child_env, start_new_session=True,
                                                  cwd=cwd if cwd and os.path.isdir(cwd) else None,
                                                  preexec_fn=_die_with_parent)
            except OSError as e:
                self.error = f"cannot start {argv[:3]}: {e}"
                self.code = 127
                self.started.set()
                self.exited.set()
                return
            if stdin is not None:
                try:
                    self.popen.stdin.write(stdin.encode())
                    self.popen.stdin.close()
                except OSError:
                    pass  # it died at once: wait() says how
            self.started.set()
            self.code = self.popen.wait()
            self.exited.set()

        threading.Thread(target=run, daemon=True, name="flowrl-child").start()
        self.started.wait()
        if self.error:
            raise RuntimeError(self.error)
        return self.popen.pid

    def wait(self) -> int:
        self.started.wait()
        self.exited.wait()
        return self.code

    def signal(self, sig: int) -> bool:
        """Send `sig` to the child; False when it is not running."""
        if self.popen is None or self.exited.is_set():
            return False
        try:
            os.kill(self.popen.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def where(self) -> tuple[int, str]:
        """(actor PID, hostname): for tests and messages."""
        import socket

        return os.getpid(), socket.gethostname()


def free_port(address: str) -> int:
    """A TCP port free now on `address`, run on the host that has it (a Ray task pinned there): a
    group's MASTER_PORT or a rank's shard channel, bound by a process that starts there next."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


# checkpoint shards between hosts (ray_launcher.RayLauncher.fetch_checkpoint): plain tasks, each
# pinned to one Ray node; the bytes travel through Ray's object store -----------------------------
def shard_digest(path: str) -> str | None:
    """sha256 of the file at `path` on this host (None: not there)."""
    import hashlib

    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return None


def read_shard(path: str) -> bytes:
    """The file's bytes, read on the host that holds it."""
    with open(path, "rb") as f:
        return f.read()


def write_shard(path: str, data: bytes, sha256: str) -> int:
    """Write `data` to `path` on this host atomically, only when its sha256 is `sha256`."""
    import hashlib

    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise ValueError(f"the bytes read have sha256 {got}, not the committed {sha256}")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.fetch{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(data)


def prune_steps(root: str, keep: list[int], newest: int) -> list[str]:
    """Delete the `stepNNNNNNNN` folders under `root` at or below `newest` that are not in `keep`
    (the committed checkpoints the run keeps); returns what went. Newer ones are being written."""
    import shutil

    gone = []
    try:
        names = os.listdir(root)
    except OSError:
        return gone
    for name in names:
        if name.startswith("step") and name[4:].isdigit() and int(name[4:]) <= newest and int(name[4:]) not in keep:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            gone.append(name)
    return gone
