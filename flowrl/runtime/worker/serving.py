"""The server side of a service (`services: [agent -> rollout]`, see services.py): a ROUTER socket
in the serving node's process; each request waits for its version gate, then runs the node's
`serve` hook on the compute thread, and its answer goes back to the client that asked.

    server = ServiceServer("rollout", serve=..., version=weight_version, recorder=rec, replica=0)
    address = server.bind("ipc://.../rollout.0.@serve")
    await server.run()
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from flowrl.agents.base import ServiceError

log = logging.getLogger("flowrl.services")

REQUEST_TIMEOUT_S = 600.0
"""A request's deadline when the caller gives none."""


_CONTEXT: list = []


def _context():
    """An asyncio view of the process's ZeroMQ context (the one the CURVE authenticator serves)."""
    from flowrl.transport.sockets import shared_context

    if not _CONTEXT:
        _CONTEXT.append(zmq.asyncio.Context.shadow(shared_context().underlying))
    return _CONTEXT[0]


def _encode(meta: dict, tensors: dict, rid: str) -> list:
    from flowrl.transport import Batch
    from flowrl.transport.codec import encode

    return encode(Batch(tensors=tensors, meta=meta, batch_id=rid))


def _decode(frames: list):
    from flowrl.transport.codec import decode

    return decode(frames)


# the server ---------------------------------------------------------------------------------------
class ServiceServer:
    """The server side in a node process with an async `serve` hook: a ROUTER bound at its address."""

    def __init__(self, node_name: str, *, serve, version, recorder: Any, replica: int, on_request=None):
        self.node_name = node_name
        self.serve = serve  # async (request dict) -> Completion, run on the compute thread by the caller
        self.version = version  # WeightVersion; None: no trainer feeds this node, nothing to wait for
        self.recorder = recorder
        self.replica = replica
        self.sock = None
        self.address = ""
        self.in_flight = 0
        self.rejected = 0
        self.changed: asyncio.Event | None = None
        self.tasks: set = set()
        self.on_request = on_request  # fault injection: called with each request's number
        self.taken = 0

    def bind(self, address: str, security: dict | None = None) -> str:
        """Bind the request socket (`security`: `input_security` of a tcp address: CURVE)."""
        from flowrl.transport.security import apply_server

        self.loop = asyncio.get_running_loop()
        self.changed = asyncio.Event()
        sock = _context().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        curve = (security or {}).get("curve")
        apply_server(sock, curve, f"service:{self.node_name}")
        if address.startswith("tcp://") and address.endswith(":0"):
            port = sock.bind_to_random_port(address.rsplit(":", 1)[0])
            address = f"{address.rsplit(':', 1)[0]}:{port}"
        else:
            sock.bind(address)
        self.sock, self.address = sock, address
        return address

    def version_changed(self, _value: int) -> None:
        """From any thread: a new version may open the gate for waiting requests."""
        self.loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    async def run(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            ident, body = frames[0].bytes, frames[1:]
            try:
                batch = _decode(body)
                meta = dict(batch.meta)
                prompt = np.asarray(batch.tensors["prompt"], dtype=np.int64)
                if prompt.ndim != 1 or not len(prompt):
                    raise ValueError(f"prompt must be a non-empty 1-d token id array, got shape {prompt.shape}")
                int(meta["max_new_tokens"]), int(meta["min_version"])
            except Exception as e:  # noqa: BLE001 - a garbled request: counted, dropped
                self.rejected += 1
                self.recorder.count("service_rejected", 1)
                log.warning("service %s: dropped a bad request: %s", self.node_name, e)
                continue
            if self.on_request is not None:
                self.on_request(self.taken)
            self.taken += 1
            task = asyncio.get_running_loop().create_task(self._answer(ident, batch.batch_id, meta, prompt))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _answer(self, ident: bytes, rid: str, meta: dict, prompt: np.ndarray) -> None:
        t0 = time.monotonic()
        deadline = t0 + float(meta.get("deadline_s", REQUEST_TIMEOUT_S))
        self.in_flight += 1
        self.gauge()
        reply: dict = {"replica": self.replica}
        tensors: dict = {}
        try:
            need = int(meta["min_version"]) if self.version is not None else -1
            while self.version is not None and self.version.value < need:  # the version gate: generated only with weights >= need
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ServiceError(f"waited {time.monotonic() - t0:.1f} s for weights version {need}; holds "
                                       f"{self.version.value}")
                try:
                    await asyncio.wait_for(self.changed.wait(), left)
                except asyncio.TimeoutError:
                    pass
            waited = time.monotonic() - t0
            if waited > 0.001:
                self.recorder.observe("service_version_wait_s", waited)
            out = await self.serve({**meta, "prompt": prompt, "request_id": rid})
            reply.update(finish=out.finish, temperature=out.temperature, top_p=out.top_p)
            tensors = {"tokens": np.asarray(out.tokens, dtype=np.int64),
                       "logprobs": np.asarray(out.logprobs, dtype=np.float32),
                       "versions": np.asarray(out.versions, dtype=np.int64)}
        except Exception as e:  # noqa: BLE001 - the client's caller gets it as a ServiceError
            reply["error"] = f"{type(e).__name__}: {e}"
            log.warning("service %s: request %s failed: %s", self.node_name, rid, reply["error"])
        finally:
            self.in_flight -= 1
            self.gauge()
            self.recorder.observe("service_serve_s", time.monotonic() - t0)
        try:
            await self.sock.send_multipart([ident, *_encode(reply, tensors, rid)], copy=False)
        except zmq.ZMQError as e:
            log.warning("service %s: could not answer %s: %s", self.node_name, rid, e)

    def gauge(self) -> None:
        """Requests in flight here: in the engine, or waiting for a version (per replica, and summed)."""
        self.recorder.gauge("service_queue", self.in_flight, across="sum")
        self.recorder.gauge("service_queue", self.in_flight, across="sum", server=f"{self.node_name}.{self.replica}")

    def close(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        if self.sock is not None:
            self.sock.close(linger=0)
