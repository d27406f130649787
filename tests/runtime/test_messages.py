"""Control messages: typed both ways, malformed ones rejected, the docs table matches the code."""

import re
from pathlib import Path

import msgpack
import pytest

from flowrl.runtime.protocol import messages as m

DOC = Path(__file__).resolve().parents[2] / "docs" / "recovery.md"


def test_every_message_round_trips_with_its_secret():
    msg = m.Consumed(batch_id="t-000001", attempt=2, index=1, epoch=3, dropped_by="filter: empty")
    out = m.decode(m.encode(msg, secret="s3cr3t"))
    assert out == msg and out.k == "s3cr3t"


@pytest.mark.parametrize("body", [
    {"t": "consumed"},                                                      # fields missing
    {"t": "consumed", "batch_id": "a", "attempt": True, "index": 1, "epoch": 0},  # bool is not an int
    {"t": "checkpointed", "step": 1.0, "epoch": 0, "file": "x"},             # float is not an int
    {"t": "ready", "pid": 1, "extra": 1},                                    # unknown field
    {"t": "nope"}, {"x": 1}, [1, 2],                                         # not a message
])
def test_malformed_control_messages_are_rejected_not_crashing(body):
    with pytest.raises(m.ControlError):
        m.decode(msgpack.packb(body))


def test_garbage_bytes_are_rejected():
    for data in (b"", b"\xc1", b"\x93\xff\x00", b"\x81" * 100, bytes(m.MAX_CONTROL_BYTES + 1)):
        with pytest.raises(m.ControlError):
            m.decode(data)


def test_the_docs_table_lists_every_message_with_its_fields():
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1] in ("node -> controller", "controller -> node", "client -> controller",
                                            "controller -> client"):
            rows[cells[0]] = (cells[1], [f for f in re.split(r",\s*", cells[2]) if f])
    code = {t: (cls.direction, list(cls.__dataclass_fields__)) for t, cls in m.message_types().items()}
    assert rows == code
