"""The code sandbox: bounded time, memory, processes and output; no network; nothing left behind."""

import socket
import threading

import psutil
import pytest

from flowrl.rewards.sandbox import Limits, isolation_mode, run_sandboxed

pytestmark = pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs POSIX")


def test_a_correct_program_reads_stdin_and_prints():
    r = run_sandboxed("import math\nprint(math.isqrt(int(input())) * 2)", "81\n")
    assert (r.status, r.stdout, r.exit_code) == ("ok", "18\n", 0)


def test_an_infinite_loop_is_stopped_by_the_cpu_limit():
    r = run_sandboxed("while True: pass", limits=Limits(cpu_s=1, wall_s=30))
    assert r.status == "cpu"  # the CPU limit ended it ("timeout" were it the wall clock)


def test_a_sleeping_program_is_killed_at_the_wall_clock_limit():
    # 5 s: the limit counts the sandbox's and the interpreter's start-up, and the print must come first
    r = run_sandboxed("import time\nprint('asleep', flush=True)\ntime.sleep(600)\nprint('woke')", limits=Limits(wall_s=5))
    assert r.status == "timeout" and r.seconds >= 5  # the wall-clock limit, once it passed
    assert r.stdout == "asleep\n" and r.exit_code is None  # killed in its sleep: it never woke or exited


def test_a_memory_hog_fails_at_the_memory_limit():
    r = run_sandboxed("chunks = []\nwhile True:\n    chunks.append(bytearray(10 << 20))", limits=Limits(memory_mb=128))
    assert r.status == "memory", r.stderr[-300:]


def test_endless_output_is_cut_at_the_output_limit():
    r = run_sandboxed("while True: print('x' * 1000)", limits=Limits(max_output_bytes=50_000))
    assert r.status == "output" and len(r.stdout) <= 50_000


def test_a_fork_bomb_is_refused_by_the_guard():
    r = run_sandboxed("import os\nwhile True:\n    os.fork()")
    assert r.status == "error" and "os.fork is not allowed" in r.stderr


@pytest.mark.skipif(isolation_mode() == "none", reason="no pid namespace here: only the audit-hook guard applies")
def test_a_fork_bomb_past_the_guard_is_held_by_the_process_limit_and_leaves_nothing_behind(monkeypatch):
    import flowrl.rewards.sandbox as sandbox

    works = []  # this run's folder: its processes (the boot and every fork of it) name it on their command line
    mkdtemp = sandbox.tempfile.mkdtemp
    monkeypatch.setattr(sandbox.tempfile, "mkdtemp", lambda **kw: works.append(mkdtemp(**kw)) or works[-1])
    code = "import os\nn = 0\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        n += 1\n"
    r = run_sandboxed(code, limits=Limits(guard=False, wall_s=2, cpu_s=1, max_procs=8))
    assert r.status in ("timeout", "cpu")  # a limit ended it; run_sandboxed returned only once all were gone
    assert len(works) == 1
    # only this run's: other tests' sandboxes (under xdist, in another worker) run as nobody too
    alive = [p for p in psutil.process_iter(["cmdline", "status"]) if p.info["status"] != psutil.STATUS_ZOMBIE
             and works[0] in (p.info["cmdline"] or [])]  # killed ones may wait a moment to be reaped
    assert not alive, "forked processes outlived the sandbox"


@pytest.mark.parametrize("guard", [True, False], ids=["with-guard", "namespace-only"])
def test_the_child_cannot_connect_to_a_server_on_loopback(guard):
    if not guard and isolation_mode() == "none":
        pytest.skip("no network namespace here: only the audit-hook guard keeps the network out")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted = []

    def accept():
        try:
            accepted.append(server.accept())
        except OSError:
            pass

    thread = threading.Thread(target=accept)
    thread.start()
    try:
        r = run_sandboxed(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')",
                          limits=Limits(guard=guard))
    finally:
        thread.join()
        server.close()
    assert r.status == "error" and "connected" not in r.stdout
    assert ("not allowed" if guard else "Network is unreachable") in r.stderr
    assert not accepted
