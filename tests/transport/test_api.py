"""The public surface of flowrl.transport, and that importing it stays light (no torch)."""

import subprocess
import sys

import flowrl.transport as transport

API = {"Batch", "Ragged", "ChannelConfig", "CurveConfig", "Sender", "Receiver", "ChannelStats", "TransportError",
       "DecodeError", "ChannelClosed", "BrokenChannel", "EndOfStream", "encode", "decode", "DecodeLimits",
       "DTYPES", "SCHEMA_VERSION"}


def test_the_public_api_is_exactly_what_the_runtime_relies_on():
    assert set(transport.__all__) == API
    assert all(hasattr(transport, name) for name in API)
    for error in ("DecodeError", "ChannelClosed", "BrokenChannel", "EndOfStream"):
        assert issubclass(getattr(transport, error), transport.TransportError)


def test_importing_the_transport_does_not_import_torch():
    code = "import sys, flowrl.transport; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
