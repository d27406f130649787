"""The data plane between node processes: tensor batches over ZeroMQ, with credit-based flow
control, acknowledgements, peer-failure handling and bounded decoding.

    from flowrl.transport import Batch, ChannelConfig, Receiver, Sender

    rx = Receiver(ChannelConfig(), name="rollout->reward")      # consumer: binds
    address = await rx.bind()
    tx = Sender(ChannelConfig(), name="rollout->reward")        # producer: connects
    await tx.connect(address)
    await tx.send(Batch(tensors={"tokens": tokens}, batch_id="t17"))
    batch = await rx.recv(); ...; await rx.ack(batch)

Layout: `batch` (the unit), `dtypes` (allow-list), `wire` (message schema, the one shared
contract), `codec` (Batch <-> frames), `config`, `flow` (consumer credit pool), `link` (producer
link state), `sender` / `receiver` (the two channel ends), `endpoints` + `ipc` / `tcp` / `inproc`
(one module per address kind), `sockets` / `security` (ZeroMQ options, CURVE), `stats`.
The protocol is described in docs/transport.md.
"""

from flowrl.transport.batch import Batch
from flowrl.transport.codec import decode, encode
from flowrl.transport.config import ChannelConfig, CurveConfig
from flowrl.transport.dtypes import DTYPES
from flowrl.transport.errors import BrokenChannel, ChannelClosed, DecodeError, EndOfStream, TransportError
from flowrl.transport.receiver import Receiver
from flowrl.transport.sender import Sender
from flowrl.transport.stats import ChannelStats
from flowrl.transport.wire import SCHEMA_VERSION, DecodeLimits

__all__ = [
    "Batch", "ChannelConfig", "CurveConfig", "Sender", "Receiver", "ChannelStats",
    "TransportError", "DecodeError", "ChannelClosed", "BrokenChannel", "EndOfStream",
    "encode", "decode", "DecodeLimits", "DTYPES", "SCHEMA_VERSION",
]
