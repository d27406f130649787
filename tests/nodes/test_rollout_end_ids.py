"""The built-in rollout ends and pads responses with the ids of the tokenizer the batch names."""

import pytest

from flowrl.nodes.rollout import Rollout
from flowrl.tasks import EOS, PAD
from tests.node_harness import make_node


def test_a_chat_models_end_of_turn_ends_responses_and_digit_tasks_keep_their_vocabulary(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"<pad>": 0, "<s>": 1, "<|im_end|>": 2, **{c: i + 3 for i, c in enumerate("0123456789+=")}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<pad>"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>",
                                         bos_token="<s>").save_pretrained(tmp_path / "tok")
    node = make_node(Rollout, {"model": {"type": "tiny"}}, name="rollout")
    assert node.end_ids({"type": "hf", "path": str(tmp_path / "tok")}) == (2, 0)
    assert node.end_ids(None) == node.end_ids({"type": "char"}) == (EOS, PAD)
