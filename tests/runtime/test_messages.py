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


def test_the_secret_is_a_declared_field_of_every_message_and_absent_from_the_wire_when_none():
    for cls in m.message_types().values():
        assert cls.__dataclass_fields__["k"].default is None
    assert m.decode(m.encode(m.Stop(k="ab"))).k == "ab"
    assert "k" not in msgpack.unpackb(m.encode(m.Stop()))
    assert m.decode(m.encode(m.Recovered(epoch=2))).k is None


def test_typed_containers_round_trip():
    msgs = [m.Ready(pid=7, store_port=None, inputs={"in": "ipc:///tmp/x"}),
            m.Heartbeat(busy=["t-000001", 1.5]), m.Heartbeat(metrics={"v": 1, "metrics": [["loss", "mean", {}]]}),
            m.Wire(routes={"a.out->b.in": [["tcp://1.2.3.4:5", "KEY"], ["ipc:///tmp/y", ""]]}),
            m.Sync(sync_epoch=1, version=2, rank=0, world_size=2, store=["127.0.0.1", 29500], timeout_s=5),
            m.Epoch(epoch=1, watermark=3, consumed=[3, 5])]
    for msg in msgs:
        assert m.decode(m.encode(msg, secret="s")) == msg


@pytest.mark.parametrize("body, names", [
    ({"t": "epoch", "epoch": 1, "watermark": 0, "consumed": ["3"]}, "epoch.consumed"),
    ({"t": "ready", "pid": 1, "inputs": {"in": 5}}, "ready.inputs"),
    ({"t": "ready", "pid": 1, "inputs": ["in"]}, "ready.inputs"),
    ({"t": "wire", "routes": {"e": [["a", None]]}}, "wire.routes"),
    ({"t": "hb", "busy": [{"x": 1}]}, "hb.busy"),
    ({"t": "hb", "metrics": [1, 2]}, "hb.metrics"),
    ({"t": "stop", "k": 5}, "stop.k"),
])
def test_a_container_field_of_the_wrong_shape_is_rejected_naming_message_and_field(body, names):
    with pytest.raises(m.ControlError, match=names.replace(".", r"\.")):
        m.decode(msgpack.packb(body, strict_types=False))


def test_a_message_with_a_bare_container_field_is_refused_when_declared():
    with pytest.raises(TypeError, match="list"):
        m._check(list, "x", "items")


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
    code = {t: (cls.direction, [f for f in cls.__dataclass_fields__ if f != "k"])  # `k`: on every message
            for t, cls in m.message_types().items()}
    assert rows == code
