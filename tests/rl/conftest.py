"""Pure-torch tests run on one torch thread (see tests/torch_threads.py)."""

from tests.torch_threads import one_torch_thread  # noqa: F401  (autouse fixture)
