"""The fork-server protocol: typed lines both ways, and a garbled line reported, never a crash.

    python -m pytest -q tests/runtime/test_forkserver.py
"""

import io
import queue
import time

import pytest

from flowrl.runtime.launch.launcher import LocalLauncher
from flowrl.runtime.protocol import forkserver as fs


def test_every_message_round_trips_as_the_json_lines_of_the_protocol():
    req = fs.StartRequest(spec="/r/procs/a.0.0.json", log="/r/logs/a.log")
    assert fs.encode(req) == b'{"spec": "/r/procs/a.0.0.json", "log": "/r/logs/a.log"}\n'
    assert fs.decode_request(fs.encode(req)) == req
    assert fs.encode(fs.Started(pid=42)) == b'{"pid": 42}\n'
    assert fs.encode(fs.Exited(pid=42, code=-9)) == b'{"exit": 42, "code": -9}\n'
    for reply in (fs.Started(pid=42), fs.Exited(pid=42, code=-9), fs.Refused(why="not JSON")):
        assert fs.decode_reply(fs.encode(reply)) == reply


@pytest.mark.parametrize("line", [b"", b"{", b"[1]\n", b'{"pid": "42"}', b'{"exit": 1}', b'{"pid": 1, "x": 2}',
                                  b'{"spec": "a"}', b'{"spec": "a", "log": 3}', b"\xff\xfe"])
def test_a_garbled_line_raises_a_protocol_error_quoting_it(line):
    with pytest.raises(fs.ForkProtocolError, match="fork-server line"):
        if b"spec" in line:
            fs.decode_request(line)
        else:
            fs.decode_reply(line)


def test_the_reader_thread_logs_a_garbled_line_and_keeps_reading(caplog):
    launcher = LocalLauncher.__new__(LocalLauncher)  # the reader alone: a server that wrote these lines
    launcher.exit_codes, launcher.replies = {}, queue.Queue()
    launcher.server = type("Server", (), {"stdout": io.BytesIO(b'garbage\n{"pid": 7}\n{"exit": 7, "code": 3}\n')})
    launcher._read()
    assert launcher.replies.get_nowait() == fs.Started(pid=7)
    assert launcher.replies.get_nowait() is None  # then the server is gone
    assert launcher.exit_codes == {7: 3}
    assert "garbage" in caplog.text


@pytest.mark.timeout(120)
def test_the_server_refuses_a_garbled_request_and_still_starts_the_next_one(tmp_path):
    launcher = LocalLauncher(start_timeout_s=60, entry="tests.runtime.forkchild")
    try:
        launcher.server.stdin.write(b"not a request\n")
        launcher.server.stdin.flush()
        refused = launcher.replies.get(timeout=60)
        assert isinstance(refused, fs.Refused) and "not a request" in refused.why
        spec = tmp_path / "spec"
        spec.write_text("3")
        handle = launcher.start(spec, tmp_path / "child.log")
        deadline = time.monotonic() + 30
        while handle.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert handle.poll() == 3
    finally:
        launcher.close()
