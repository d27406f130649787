"""Shared fixture: pure-torch tests run on one thread, as a node process does."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Train on one thread, as a node does: on a shared 2-core machine more threads only contend."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
