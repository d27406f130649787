"""Fixtures of the transport tests (helpers live in `helpers.py`)."""

import pytest


@pytest.fixture
def anyio_backend():
    return "asyncio"
