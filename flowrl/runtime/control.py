"""The control plane between the controller and node processes: small msgpack messages over ZeroMQ.

The controller binds one ROUTER socket; each node process connects a DEALER whose identity is its
`ProcId` (`node/replica/rank#incarnation`). Batch payloads never travel here — only tickets,
handshakes, heartbeats with metrics, consumption reports and weight-sync orders.

Message types (field `t`), written down once:

node -> controller
    ready        {pid, store_port?}         setup done, inputs bound; safe to rely on this process
    hb           {metrics?}                 heartbeat (every supervision.heartbeat_s)
    consumed     {batch_id, attempt, index, policy_version, staleness}   a sink consumed a ticket
    published    {version}                  a publisher finished update -> new weights version
    synced       {version, epoch}           a subscriber holds weights `version`
    sync_failed  {epoch, error}             a weight broadcast failed or timed out
    checkpointed {step, applied}            a stateful node saved its state for checkpoint `step`
    dropped      {batch_id, attempt, why}   a duplicate or invalid batch was dropped
    error        {where, message, traceback} the node failed; it exits right after
controller -> node
    start        {}                         all nodes are ready: begin
    ticket       {batch_id, index, attempt, min_policy_version, size}   (sources only)
    sync         {epoch, version, rank, world_size, store, bucket_bytes}  join weight broadcast
    checkpoint   {step, path}               save state now
    stop         {}                         finish and exit 0
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

MAX_CONTROL_BYTES = 16 << 20


@dataclass(frozen=True)
class ProcId:
    node: str
    replica: int
    rank: int = 0

    def __str__(self) -> str:
        return f"{self.node}/{self.replica}/{self.rank}"

    @classmethod
    def parse(cls, text: str) -> "ProcId":
        node, replica, rank = text.split("#")[0].split("/")
        return cls(node, int(replica), int(rank))


def pack(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(data: bytes) -> dict:
    """Decode one control message; raises ValueError for anything that is not a small map with `t`."""
    if len(data) > MAX_CONTROL_BYTES:
        raise ValueError(f"control message of {len(data)} bytes exceeds {MAX_CONTROL_BYTES}")
    msg = msgpack.unpackb(data, raw=False, strict_map_key=True)
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise ValueError("control message is not a map with a string field 't'")
    return msg
