"""The heartbeat thread of a node process: liveness that a long call cannot hide, and its duration."""

from __future__ import annotations

import os
import threading
import time

import zmq

from flowrl.runtime.protocol import messages as m
from flowrl.runtime.protocol.addresses import connect_control
from flowrl.runtime.protocol.procspec import ProcSpec


class Heartbeat(threading.Thread):
    """Says 'alive' from its own thread and socket, so a long torch call (which releases the GIL)
    does not look like a hang, while a stopped process (SIGSTOP) or a dead controller does. It
    also says how long the node has been inside its current call, so a call that never returns
    (a wedged collective, a bug) is found by `process_timeout_s` although the process is alive."""

    def __init__(self, spec: ProcSpec):
        super().__init__(daemon=True, name="flowrl-heartbeat")
        self.spec = spec
        self.parent = os.getppid()
        self.worker = None  # the Worker, whose `busy` says which call runs since when

    def run(self) -> None:
        sock = connect_control(zmq.Context.instance(), self.spec, suffix="#hb", sndhwm=16)
        while True:
            if os.getppid() != self.parent:  # our launcher is gone: nobody will stop us
                os._exit(70)
            busy = self.worker.busy if self.worker is not None else None
            msg = m.Heartbeat(busy=[busy[0][:256], round(time.monotonic() - busy[1], 3)] if busy else None)
            try:
                sock.send(m.encode(msg, self.spec.secret), zmq.NOBLOCK)
            except zmq.Again:
                pass
            time.sleep(self.spec.heartbeat_s)
