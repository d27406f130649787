"""`Concurrent` on its own: at most `limit` calls run, the rest wait without blocking the caller,
a finished call starts the next, an error goes to the event loop, a recovery drops the waiting."""

import anyio
import pytest

from flowrl.runtime.worker.concurrent import Concurrent

pytestmark = pytest.mark.timeout(30)


class Item:
    def __init__(self, i):
        self.batch_id = f"t-{i}"


def test_at_most_limit_calls_run_and_a_finished_call_starts_the_next():
    async def main():
        calls, started, release = Concurrent(limit=2), [], {i: anyio.Event() for i in range(3)}

        async def call(item):
            started.append(item.batch_id)
            await release[int(item.batch_id[2:])].wait()

        async with anyio.create_task_group() as tg:
            calls.bind(tg.start_soon, None)
            for i in range(3):
                await calls.start(call, Item(i))  # returns at once, even when every slot is taken
            await anyio.wait_all_tasks_blocked()
            assert started == ["t-0", "t-1"] and len(calls.waiting) == 1 and "2/2" in calls.dump()
            release[1].set()
            await anyio.wait_all_tasks_blocked()
            assert started == ["t-0", "t-1", "t-2"] and len(calls.running) == 2
            release[0].set(), release[2].set()
        assert not calls.running and not calls.waiting

    anyio.run(main)


def test_an_error_goes_to_the_event_loop_and_a_recovery_drops_the_waiting():
    async def main():
        calls, errors, gate = Concurrent(limit=1), [], anyio.Event()

        async def fail(item):
            await gate.wait()
            raise ValueError(item.batch_id)

        async with anyio.create_task_group() as tg:
            calls.bind(tg.start_soon, errors.append)
            await calls.start(fail, Item(0))
            await calls.start(fail, Item(1))
            assert [i.batch_id for i in calls.drop_waiting()] == ["t-1"]
            gate.set()
        assert [str(e) for e in errors] == ["t-0"] and not calls.running

    anyio.run(main)
