"""Runs inside the sandbox (python -I _sandbox_boot.py WORKDIR LIMITS_JSON); see sandbox.py.

Pid 1 of the fresh pid namespace stays a small reaper: the kernel treats a namespace's init
specially (it ignores SIGXCPU, so the CPU limit would only bite at the hard limit), so the user's
code runs in a forked child, with the limits set and privileges dropped there. When the child
ends, this process writes its status and exits, and the kernel kills whatever the child left.
"""

import json
import os
import resource
import sys

# Imported before privileges are dropped: where the Python installation is not readable by the
# sandbox user (a pyenv under /root), only modules already loaded can be imported by the code.
PRELOAD = ("traceback", "math", "cmath", "itertools", "functools", "collections", "heapq", "bisect",
           "re", "string", "json", "fractions", "decimal", "random", "statistics", "operator", "copy",
           "typing", "dataclasses", "io", "array", "enum", "numbers", "datetime", "time", "textwrap",
           "socket", "select", "encodings.idna")

BLOCKED = ("socket.", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system",
           "subprocess.Popen", "os.kill", "os.killpg", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata",
           "pty.spawn", "os.setuid", "os.setgid")


def _guard(event, args):
    if event.startswith(BLOCKED):
        raise PermissionError(f"sandbox: {event} is not allowed")


def _child(work, limits):
    set_ = resource.setrlimit
    set_(resource.RLIMIT_CORE, (0, 0))
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    if os.getuid() == 0 and limits["drop_to_uid"] is not None:
        os.setgroups([])
        os.setgid(limits["drop_to_uid"])
        os.setuid(limits["drop_to_uid"])
    cpu = int(limits["cpu_s"] + 0.999)
    set_(resource.RLIMIT_CPU, (cpu, cpu + 1))
    set_(resource.RLIMIT_AS, (limits["memory_bytes"], limits["memory_bytes"]))
    set_(resource.RLIMIT_NPROC, (limits["max_procs"], limits["max_procs"]))
    set_(resource.RLIMIT_FSIZE, (limits["max_output_bytes"], limits["max_output_bytes"]))
    set_(resource.RLIMIT_NOFILE, (64, 64))
    with open(os.path.join(work, "solution.py"), encoding="utf-8") as f:
        code = compile(f.read(), "solution.py", "exec")
    os.chdir(os.path.join(work, "cwd"))
    if limits["guard"]:
        sys.addaudithook(_guard)
    sys.argv = ["solution.py"]
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})


def main():
    work, limits = sys.argv[1], json.loads(sys.argv[2])
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            _child(work, limits)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
    while True:  # reap everything (the child's children are re-parented to pid 1) until it ends
        try:
            got, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if got == pid:
            result = {"exit": os.waitstatus_to_exitcode(status)}
            tmp = os.path.join(work, "status.json.tmp")
            with open(tmp, "w") as f:
                json.dump(result, f)
            os.replace(tmp, os.path.join(work, "status.json"))
            break
    os._exit(0)


if __name__ == "__main__":
    main()
