"""The `anyio_backend` fixture of tests that must hold on both event loops the runtime may run:
asyncio's own and uvloop (runtime/protocol/loops.py). Import it into a test module:

    from tests.loop_backends import anyio_backend  # noqa: F401 - asyncio's loop and uvloop
"""

import pytest


@pytest.fixture(params=[pytest.param(("asyncio", {}), id="asyncio"),
                        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop")])
def anyio_backend(request):
    if request.param[1]:
        pytest.importorskip("uvloop")
    return request.param
