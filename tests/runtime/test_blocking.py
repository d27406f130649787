"""`blocking.run` (flowrl/runtime/worker/blocking.py): blocking calls on helper threads, awaited
from the event loop, on asyncio's loop and on uvloop."""

from __future__ import annotations

import threading

import anyio
import pytest

from flowrl.runtime.worker import blocking
from tests.loop_backends import anyio_backend  # noqa: F401 - asyncio's loop and uvloop

pytestmark = [pytest.mark.timeout(60), pytest.mark.anyio]


async def test_a_call_runs_off_the_loop_and_returns_or_raises_here():
    loop_thread = threading.get_ident()
    first = await blocking.run(threading.get_ident)
    assert first != loop_thread
    assert await blocking.run(threading.get_ident) == first  # an idle thread is reused
    error = ValueError("from the thread")

    def fails():
        raise error

    with pytest.raises(ValueError) as e:
        await blocking.run(fails)
    assert e.value is error


async def test_calls_never_wait_for_each_other():
    """A call that blocks until another call of the same process ran (a publisher's round waiting
    for a subscriber's) must not hold that one back."""
    released = threading.Event()
    got = []

    async def waits():
        got.append(await blocking.run(lambda: released.wait(20)))

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waits)
            await blocking.run(released.set)
    assert got == [True]


async def test_a_cancelled_caller_waits_for_its_call_to_return():
    started, release = threading.Event(), threading.Event()
    state = {"returned": False}
    exits = []

    def call():
        started.set()
        release.wait(20)
        state["returned"] = True

    async def caller(scope):
        with scope:
            await blocking.run(call)
        exits.append(state["returned"])

    scope = anyio.CancelScope()
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(caller, scope)
            await anyio.to_thread.run_sync(started.wait, 20)
            scope.cancel()
            for _ in range(20):  # the loop turns: a caller that did not wait would have left now
                await anyio.sleep(0)
            assert exits == []
            release.set()
    assert exits == [True] and scope.cancel_called


async def test_a_forked_child_makes_threads_of_its_own():
    """The parent's idle threads do not exist in a child (fork copies one thread): a child that
    handed its call to one of them would wait forever."""
    import os

    await blocking.run(threading.get_ident)  # the parent has an idle helper thread now
    assert blocking._idle
    pid = os.fork()
    if pid == 0:  # the child: a plain call on a loop of its own, its verdict in the exit code
        import asyncio

        try:
            ok = asyncio.run(asyncio.wait_for(blocking.run(lambda: 7), 10)) == 7
        except BaseException:  # noqa: BLE001
            ok = False
        os._exit(0 if ok else 1)
    with anyio.fail_after(30):
        _, status = await anyio.to_thread.run_sync(os.waitpid, pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


async def test_stop_iteration_comes_back_as_an_error_and_a_cancelled_caller_starts_nothing():
    def stops():
        raise StopIteration("done")

    with anyio.fail_after(10), pytest.raises(RuntimeError, match="StopIteration"):
        await blocking.run(stops)
    ran = []
    with anyio.CancelScope() as scope:
        scope.cancel()
        await blocking.run(lambda: ran.append(1))
    assert ran == [] and scope.cancelled_caught
