"""The service client and server (flowrl/runtime/worker/services.py) over real ZeroMQ sockets in one
process: sticky and least-loaded routing, a replica that goes away mid-request, the version gate,
deadlines, a server error and a garbled request."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import zmq
import zmq.asyncio

from flowrl.agents.base import Completion, ServiceError
from flowrl.metrics import Recorder
from flowrl.runtime.worker.services import ServiceClient, ServiceServer
from flowrl.runtime.worker.version import WeightVersion

pytestmark = pytest.mark.timeout(60)


class Replica:
    """A server whose `serve` answers with its replica id, or holds requests until released."""

    def __init__(self, path, i, version=None, hold=False):
        self.i, self.hold, self.seen = i, hold, []
        self.release = asyncio.Event()
        self.server = ServiceServer("rollout", serve=self.serve, version=version, recorder=Recorder(node="rollout", replica=i),
                                    replica=i)
        self.address = self.server.bind(f"ipc://{path}/r{i}")
        self.task = asyncio.get_running_loop().create_task(self.server.run())

    async def serve(self, request):
        self.seen.append(request["session"])
        if request.get("fail"):
            raise ValueError("prompt 0 is too long")
        if self.hold:
            await self.release.wait()
        return Completion(tokens=[self.i, 13], logprobs=[-0.5, -0.1], versions=[7, 7], replica=self.i)

    def kill(self):
        self.task.cancel()
        self.server.close()


async def client_for(*replicas) -> ServiceClient:
    client = ServiceClient("rollout", recorder=Recorder(node="agent", replica=0))
    client.bind_loop()
    await client.connect([[r.address, ""] for r in replicas])
    return client


async def ask(client, session, timeout_s=20.0, **meta):
    return await client.handle().complete([12, 1, 2], session=session, max_new_tokens=4, stop=(13,),
                                          timeout_s=timeout_s, **meta)


def test_sessions_stick_to_their_replica_and_new_ones_go_to_the_least_loaded(tmp_path):
    async def main():
        # the replicas hold every request until all six are in: none is answered (and unloads its
        # replica) before the last is sent, however the machine schedules the tasks
        a, b = Replica(tmp_path, 0, hold=True), Replica(tmp_path, 1, hold=True)
        client = await client_for(a, b)
        asked = asyncio.gather(*(ask(client, f"s{i}") for i in range(6)))
        while len(a.seen) + len(b.seen) < 6:  # polling the servers' progress, not ordering events
            await asyncio.sleep(0.01)
        a.release.set()
        b.release.set()
        first = await asked
        assert sorted(c.replica for c in first) == [0, 0, 0, 1, 1, 1]  # spread while in flight together
        again = [await ask(client, f"s{i}") for i in range(6)]
        assert [c.replica for c in again] == [c.replica for c in first]  # each session stays where it was
        assert again[0].tokens == [first[0].replica, 13] and again[0].versions == [7, 7]
        client.close(), a.kill(), b.kill()

    asyncio.run(main())


def test_requests_in_flight_on_a_replica_that_goes_away_are_answered_by_another(tmp_path):
    async def main():
        a, b = Replica(tmp_path, 0, hold=True), Replica(tmp_path, 1)
        client = await client_for(a, b)
        while not all(r.up for r in client.replicas):  # both connected (monitor events)
            await asyncio.sleep(0.01)
        calls = [asyncio.create_task(ask(client, f"s{i}")) for i in range(4)]
        while len(a.seen) < 2:  # two of them are in flight at the replica that holds them
            await asyncio.sleep(0.01)
        a.kill()  # its connection drops: what it held goes to replica 1
        out = await asyncio.gather(*calls)
        assert [c.replica for c in out] == [1, 1, 1, 1]
        assert client.retries == 2
        client.close(), b.kill()

    asyncio.run(main())


def test_the_version_gate_holds_a_request_until_the_version_arrives_or_its_deadline(tmp_path):
    async def main():
        version = WeightVersion(SimpleNamespace())
        a = Replica(tmp_path, 0, version=version)
        a.server.version_changed(0)
        version.listen(a.server.version_changed)
        client = await client_for(a)
        with pytest.raises(ServiceError, match="waited .* for weights version 2; holds 0"):
            await ask(client, "late", timeout_s=0.5, min_version=2)
        call = asyncio.create_task(ask(client, "s", min_version=2))
        while a.server.in_flight == 0:
            await asyncio.sleep(0.01)
        assert not call.done() and a.seen == []
        version.set(2)
        assert (await call).replica == 0
        client.close(), a.kill()

    asyncio.run(main())


def test_no_server_is_a_service_error_at_the_deadline_not_a_hang(tmp_path):
    async def main():
        client = ServiceClient("rollout")
        client.bind_loop()
        await client.connect([[f"ipc://{tmp_path}/nobody", ""]])
        with pytest.raises(ServiceError, match="no answer within"):
            await ask(client, "s", timeout_s=0.3)
        assert client.pending == {}
        client.close()

    asyncio.run(main())


def test_a_server_error_comes_back_named_and_a_garbled_request_is_dropped(tmp_path):
    async def main():
        a = Replica(tmp_path, 0)
        client = await client_for(a)
        with pytest.raises(ServiceError, match="replica 0: ValueError: prompt 0 is too long"):
            await client.request({"max_new_tokens": 2, "min_version": 0, "fail": True}, np.array([1]), "s", 10)
        junk = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        junk.connect(a.address)
        await junk.send_multipart([b"\x93\xff\x00garbage", b"x" * 16])
        # the junk comes on a connection of its own: nothing orders it before the next request
        deadline = asyncio.get_running_loop().time() + 10
        while not a.server.rejected and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert a.server.rejected == 1
        assert (await ask(client, "after")).replica == 0  # still serving
        junk.close(linger=0), client.close(), a.kill()

    asyncio.run(main())
