"""A fork server for node processes: imports torch once, then forks a node process per request.

    python -m flowrl.runtime.launch.forkserver ENTRY [MODULE ...]
    (started by LocalLauncher; speaks JSON lines)

A fresh `import torch` costs about 1.5 s on a small CPU; a fork of a process that has already
imported it costs milliseconds, which is what makes replacing a dead node fast. The MODULEs are
what the run's node classes preload (`Node.preload`: torch and torch._dynamo unless a node says
less), imported before the entry; a graph of nodes that never touch torch does not pay for it.

Lifetime is tied to the controller, so nothing outlives a `kill -9` of `flowrl run`:
the server asks the kernel for SIGKILL when its parent (the controller) dies, and exits when its
stdin closes; every node it forks asks for SIGKILL when the server dies. The server reaps its
children and reports each exit status, so the controller still sees exit codes and signals.

Protocol: one JSON object per line, typed in `flowrl/runtime/protocol/forkserver.py`
(StartRequest in; Started or Refused per request, in order, and Exited per child out).
"""

from __future__ import annotations

import gc
import importlib
import os
import select
import signal
import sys

from flowrl.runtime.launch.child import die_with_parent, run_child
from flowrl.runtime.protocol.forkserver import Exited, ForkProtocolError, Refused, Started, decode_request, encode

def _decode_status(status: int) -> int:
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _write(out, msg: Started | Refused | Exited) -> None:
    out.write(encode(msg))
    out.flush()


def preload(modules: list[str]) -> None:
    """Import each module once, before any fork (torch._dynamo: the first optimizer step a trainer
    takes imports it, ~2 s on a small CPU, which a restarted actor or critic should not pay again).
    One that fails to import is reported and skipped: the node that needs it fails in its own
    process, with its own log saying why, and the others are not held up."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - ImportError, or the module's own code failing
            print(f"flowrl fork server: preloading {name!r} failed ({type(e).__name__}: {e}); "
                  "the node processes that need it import it themselves", file=sys.stderr, flush=True)


def serve(entry: str, modules: list[str]) -> None:
    """`entry`: the module every forked child runs (its `main([spec_path])`), imported here once
    after `modules` (see `preload`)."""
    parent = os.getppid()
    die_with_parent()
    if os.getppid() != parent:  # the controller died before prctl took effect
        os._exit(0)
    preload(modules)

    import flowrl.metrics  # noqa: F401
    import flowrl.transport  # noqa: F401

    importlib.import_module(entry)

    gc.collect()
    gc.freeze()  # every child inherits these objects; the cyclic collector never walks them again

    sys.stdout.flush()
    out = sys.stdout.buffer  # JSON lines as bytes (protocol/forkserver.py), flushed one by one
    stdin = sys.stdin.fileno()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the controller, which stops us
    buf = b""
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([stdin, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        while children:  # reap
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            _write(out, Exited(pid=pid, code=_decode_status(status)))
        if stdin in ready:
            chunk = os.read(stdin, 65536)
            if not chunk:  # the controller closed our stdin (or died): end
                for pid in children:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                os._exit(0)
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                try:
                    req = decode_request(line)
                except ForkProtocolError as e:  # answered, so the launcher's start fails now, naming it
                    _write(out, Refused(why=str(e)))
                    continue
                pid = os.fork()
                if pid == 0:
                    os.close(wake_r)
                    os.close(wake_w)
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    die_with_parent()
                    run_child(entry, req.spec, req.log)
                children.add(pid)
                _write(out, Started(pid=pid))


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])
