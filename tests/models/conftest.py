"""Pure-torch tests run on one torch thread (see tests/torch_threads.py); a tiny saved Llama for the HF tests."""

import pytest
import torch

from tests.torch_threads import one_torch_thread  # noqa: F401  (autouse fixture)


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    """A tiny randomly initialised Llama (task vocabulary, GQA) saved to a temp folder."""
    transformers = pytest.importorskip("transformers")
    from flowrl.tasks import VOCAB_SIZE

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)
