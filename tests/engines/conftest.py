"""A tiny random Llama + character tokenizer (examples/hf_tiny/make_model.py), written once per session."""

from __future__ import annotations

import pytest

from tests.torch_threads import one_torch_thread  # noqa: F401  (autouse fixture)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    pytest.importorskip("transformers")
    from examples.hf_tiny.make_model import write_model

    return str(write_model(tmp_path_factory.mktemp("hf-tiny") / "model", "tiny", seed=0, max_len=64))
