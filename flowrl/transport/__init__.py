"""The data plane between node processes: tensor batches over ZeroMQ, with credit-based flow
control, acknowledgements, peer-failure handling and bounded decoding.

    from flowrl.transport import Batch, ChannelConfig, Receiver, Sender

    async with Receiver(ChannelConfig(), name="rollout->reward") as rx:      # consumer: binds
        address = await rx.bind()
        async with Sender(ChannelConfig(), name="rollout->reward") as tx:    # producer: connects
            await tx.connect(address)
            await tx.send(Batch(tensors={"tokens": tokens}, batch_id="t17"))
            batch = await rx.recv(); ...; await rx.ack(batch)

Layout: `batch` (the unit), `ragged` (its variable-length tensors) and `dtypes` (its allow-list); `wire` (the message schema, the one
contract both ends share), `codec` (Batch <-> frames, bounded decoding); `config`, `stats`,
`errors`; `receiver` (consumer end) with `flow` (its credit pool); `sender` (producer end) with
`link` (per-replica state); `endpoints` + `ipc` / `tcp` / `inproc` (one module per address kind);
`sockets` (ZeroMQ options and the event-loop pump), `security` (CURVE) and `tasks` (each end's
background work, in a task group that `async with` opens or its owner passes as `task_group=`).
The protocol, its guarantees and the benchmark are described in docs/transport.md.
"""

from flowrl.transport.batch import Batch
from flowrl.transport.codec import decode, encode
from flowrl.transport.config import ChannelConfig, CurveConfig
from flowrl.transport.dtypes import DTYPES
from flowrl.transport.errors import BrokenChannel, ChannelClosed, DecodeError, EndOfStream, TransportError
from flowrl.transport.ragged import Ragged
from flowrl.transport.receiver import Receiver
from flowrl.transport.sender import Sender
from flowrl.transport.stats import ChannelStats
from flowrl.transport.wire import SCHEMA_VERSION, DecodeLimits

__all__ = [
    "Batch", "Ragged", "ChannelConfig", "CurveConfig", "Sender", "Receiver", "ChannelStats",
    "TransportError", "DecodeError", "ChannelClosed", "BrokenChannel", "EndOfStream",
    "encode", "decode", "DecodeLimits", "DTYPES", "SCHEMA_VERSION",
]
