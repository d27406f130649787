"""Pure-torch tests run on one torch thread (see tests/torch_threads.py); a tiny saved Llama for the HF tests."""

import pytest
import torch

from tests.torch_threads import one_torch_thread  # noqa: F401  (autouse fixture)


def _save_tiny(tmp_path_factory, name: str, make_config) -> str:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(name)
    transformers.AutoModelForCausalLM.from_config(make_config(transformers)).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    """A tiny randomly initialised Llama (task vocabulary, GQA, rotary positions) in a temp folder."""
    from flowrl.tasks import VOCAB_SIZE

    return _save_tiny(tmp_path_factory, "tiny-llama", lambda t: t.LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    ))


@pytest.fixture(scope="session")
def hf_gpt2_dir(tmp_path_factory):
    """A tiny randomly initialised GPT-2 in a temp folder: learned absolute positions, so a wrong
    position id changes its outputs (rotary attention only sees position differences)."""
    from flowrl.tasks import VOCAB_SIZE

    return _save_tiny(tmp_path_factory, "tiny-gpt2", lambda t: t.GPT2Config(
        vocab_size=VOCAB_SIZE, n_embd=32, n_layer=2, n_head=4, n_positions=64,
        bos_token_id=0, eos_token_id=0,
    ))
