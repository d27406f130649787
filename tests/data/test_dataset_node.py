"""The `dataset` source node: the prompts node's tensors from a file, answers as UTF-8 targets."""

import json

import pytest
import torch

import flowrl

from flowrl.data import CharTokenizer, decode_answers
from flowrl.nodes.dataset import Dataset
from flowrl.runtime.node import Ticket
from flowrl.tasks import PAD
from tests.node_harness import call, make_node

MODEL = {"type": "tiny", "vocab_size": 102, "max_seq_len": 96}


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"question": f"{a}+{b}" + "?" * (a % 3), "answer": str(a + b)} for a in range(4) for b in range(3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, rows


def ticket(index, size):
    return Ticket(batch_id=f"t-{index:06d}", index=index, attempt=0, min_policy_version=0, size=size)


def test_a_ticket_becomes_prompts_of_their_own_length_with_their_answers(data):
    path, rows = data
    node = make_node(Dataset, {"path": str(path), "template": "Q: {question}=", "model": MODEL, "max_new_tokens": 4})
    batch = call(node.generate, ticket(0, 5))
    prompts, targets, ids = batch.tensors["prompts"], batch.tensors["targets"], batch.tensors["rows"].tolist()
    assert isinstance(prompts, flowrl.Ragged) and prompts.num_samples == 5 and "prompt_len" not in batch.meta
    assert batch.meta["max_new_tokens"] == 4 and batch.meta["tokenizer"] == {"type": "char"}
    tok = CharTokenizer()
    for p, i in zip(prompts, ids):
        assert p.tolist() == tok.encode(f"Q: {rows[i]['question']}=")  # exactly its tokens: no padding
    assert PAD not in prompts.values.tolist()
    assert decode_answers(targets) == [rows[i]["answer"] for i in ids]
    # a replayed ticket gets the very same batch
    again = call(node.generate, ticket(0, 5))
    assert torch.equal(again.tensors["prompts"].values, prompts.values) and again.tensors["rows"].tolist() == ids


def test_max_prompt_tokens_is_a_cap_that_never_pads_and_names_the_row_it_refuses(data):
    path, _ = data
    node = make_node(Dataset, {"path": str(path), "model": MODEL, "max_prompt_tokens": 12})
    prompts = call(node.generate, ticket(1, 4)).tensors["prompts"]
    assert prompts.num_samples == 4 and int(prompts.lengths.max()) <= 12 and PAD not in prompts.values.tolist()
    node = make_node(Dataset, {"path": str(path), "model": MODEL, "max_prompt_tokens": 3})
    with pytest.raises(ValueError, match=r"row \d+: its prompt has \d+ tokens, more than max_prompt_tokens=3"):
        call(node.generate, ticket(0, 4))


def test_epochs_run_out_with_a_clear_error(data):
    path, rows = data
    node = make_node(Dataset, {"path": str(path), "model": MODEL, "epochs": 1})
    call(node.generate, ticket(2, 4))  # rows 8..11 of 12: still epoch 1
    with pytest.raises(ValueError, match="past epochs=1"):
        call(node.generate, ticket(3, 4))


def test_config_mistakes_fail_at_setup_naming_the_fix(data):
    path, _ = data
    with pytest.raises(ValueError, match="uses field 'problem'"):
        make_node(Dataset, {"path": str(path), "template": "{problem}", "model": MODEL})
    with pytest.raises(ValueError, match="set `answer_field:`"):
        make_node(Dataset, {"path": str(path), "answer_field": "solution", "model": MODEL})
    with pytest.raises(ValueError, match="vocab_size: 102"):
        make_node(Dataset, {"path": str(path), "model": {"type": "tiny"}})


def test_a_hugging_face_tokenizer_and_its_chat_template_tokenize_the_prompts(data, tmp_path):
    pytest.importorskip("transformers")
    from flowrl.export.tokenizer import save_char_tokenizer

    folder = tmp_path / "hf"
    save_char_tokenizer(folder, 102)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    path, rows = data
    node = make_node(Dataset, {"path": str(path), "model": {"type": "hf", "path": str(folder)}, "chat_template": True,
                               "system": "Be brief."})
    batch = call(node.generate, ticket(0, 2))
    assert batch.meta["tokenizer"]["type"] == "hf"
    for p, i in zip(batch.tensors["prompts"], batch.tensors["rows"].tolist()):
        assert node.tokenizer.pad_id not in p.tolist()  # the prompt's own tokens, nothing in front
        text = node.tokenizer.tok.decode(p.tolist())
        assert text.endswith(f"system: Be brief.\nuser: {rows[i]['question']}\nassistant:")
