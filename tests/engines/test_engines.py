"""The rollout engine seam without vLLM: the factory, the built-in and Hugging Face engines, the
layout every engine produces (ragged prompts in, each sample its own prompt + its own response),
weights in, bad prompts refused, and the tokenizer the example model ships with."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowrl.engines import Sampling, build_engine, parse_engine_spec
from flowrl.engines.base import pack_completions
from flowrl.models import build_model, generate
from flowrl.tasks import EOS, PAD, encode
from flowrl.transport.ragged import Ragged
from tests.engines.layout import RAGGED, RECT, assert_batch_equals_alone, assert_layout, recompute, too_long

TINY = {"type": "tiny", "d_model": 32, "n_layers": 1, "n_heads": 2}


def sampling(**kw):
    return Sampling(**{"n": 4, "temperature": 1.0, "max_new_tokens": 5, "eos_id": EOS, "pad_id": PAD, **kw})


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    return {"type": "hf", "path": tiny_llama}


@pytest.fixture(scope="module")
def hf_engine(hf_model):
    return build_engine({"type": "hf"}, model=hf_model)


@pytest.fixture(scope="module")
def engines(hf_model, hf_engine):
    """Every engine this file runs, by name: the builtin one on both model types, and hf."""
    return {"builtin": build_engine({"type": "builtin"}, model=TINY, seed=3),
            "builtin-hf": build_engine({"type": "builtin"}, model=hf_model), "hf": hf_engine}


# builtin -------------------------------------------------------------------------------------
def test_builtin_engine_samples_exactly_what_flowrls_sampler_did_for_the_same_seed():
    engine = build_engine({"type": "builtin"}, model=TINY, seed=3)
    out = engine.generate(RAGGED, sampling(), seed=11)
    assert_layout(out, RAGGED, 4, 5)
    policy = build_model(TINY, seed=3).eval()
    repeated = RAGGED.select(np.repeat(np.arange(RAGGED.num_samples), 4))
    want = generate(policy, repeated, max_new_tokens=5, temperature=1.0, eos_id=EOS, pad_id=PAD,
                    generator=torch.Generator().manual_seed(11))
    assert torch.equal(out.tokens.values, want.tokens.values) and torch.equal(out.tokens.offsets, want.tokens.offsets)
    assert torch.equal(out.logprobs.values, want.logprobs.values.float())


def test_builtin_engine_generates_from_the_tensors_the_runtime_writes_into():
    engine = build_engine({"type": "builtin"}, model=TINY, seed=0)
    other = build_model(TINY, seed=1).state_dict()
    live = engine.weights()
    for name, tensor in other.items():  # what the runtime does: receive into the live tensors
        live[name].copy_(tensor)
    engine.load_weights(live.items(), version=1)
    fresh = build_engine({"type": "builtin"}, model=TINY, seed=1)
    got, want = engine.generate(RAGGED, sampling(), seed=0), fresh.generate(RAGGED, sampling(), seed=0)
    assert torch.equal(got.tokens.values, want.tokens.values)
    engine.load_weights(build_model(TINY, seed=0).state_dict().items(), version=2)  # a loader callback
    assert engine.version == 2
    assert torch.equal(engine.weights()["tok_emb.weight"], build_model(TINY, seed=0).tok_emb.weight)
    with pytest.raises(KeyError, match="not a parameter of the rollout model"):
        engine.load_weights([("nope.weight", torch.zeros(1))], version=3)


def test_an_unknown_engine_or_a_tiny_model_under_vllm_is_a_clear_error():
    with pytest.raises(ValueError, match="choose one of builtin, hf, vllm"):
        parse_engine_spec({"type": "sglang"})
    with pytest.raises(ValueError, match="Extra inputs"):
        parse_engine_spec({"type": "vllm", "gpu_mem": 0.3})
    with pytest.raises(ValueError, match=r"runs a Hugging Face checkpoint.*make_model.py"):
        build_engine({"type": "vllm"}, model=TINY)


# the layout ----------------------------------------------------------------------------------
def test_pack_completions_keeps_each_prompt_and_cuts_after_the_first_stop():
    prompts = Ragged.from_sequences([[12, 15, 4, 11], [12, 15, 8, 3, 9, 11]])
    completions = [([3, EOS, 4], [-1.0, -2.0, -3.0]), ([1, 2], [-0.5, -0.5]),
                   ([5, 6, 7, 8, 9], [-0.25] * 5), ([EOS], [-0.75])]
    out = pack_completions(prompts, completions, sampling(n=2, max_new_tokens=4))
    assert out.prompt_lens.tolist() == [4, 4, 6, 6] and out.tokens.aligned(out.loss_mask)
    assert [m.tolist() for m in out.loss_mask] == [[False] * 4 + [True] * 2, [False] * 4 + [True] * 2,
                                                   [False] * 6 + [True] * 4, [False] * 6 + [True]]
    assert [t.tolist() for t in out.tokens] == [[12, 15, 4, 11, 3, EOS], [12, 15, 4, 11, 1, 2],
                                                [12, 15, 8, 3, 9, 11, 5, 6, 7, 8], [12, 15, 8, 3, 9, 11, EOS]]
    assert [lp.tolist() for lp in out.logprobs] == [[0.0] * 4 + [-1.0, -2.0], [0.0] * 4 + [-0.5, -0.5],
                                                    [0.0] * 6 + [-0.25] * 4, [0.0] * 6 + [-0.75]]
    assert out.responses(PAD).tolist() == [[3, EOS, PAD, PAD], [1, 2, PAD, PAD], [5, 6, 7, 8], [EOS, PAD, PAD, PAD]]
    with pytest.raises(ValueError, match=r"expected 4 completions \(2 prompts x n=2\), got 1"):
        pack_completions(prompts, completions[:1], sampling(n=2))


def test_a_rectangular_batch_is_still_taken_as_full_length_prompts(hf_engine):
    completions = [([EOS], [-1.0])] * 3
    legacy = pack_completions(RECT, completions, sampling(n=1))
    ragged = pack_completions(Ragged.from_padded(RECT, torch.full((3,), 7)), completions, sampling(n=1))
    assert torch.equal(legacy.tokens.values, ragged.tokens.values) and legacy.prompt_lens.tolist() == [7, 7, 7]
    out = hf_engine.generate(RECT, sampling(n=2), seed=3)
    assert_layout(out, Ragged.from_padded(RECT, torch.full((3,), 7)), 2, 5)


@pytest.mark.parametrize("name", ["builtin", "builtin-hf", "hf"])
def test_every_engine_starts_each_sample_with_exactly_its_own_prompt(engines, name):
    out = engines[name].generate(RAGGED, sampling(temperature=0.9), seed=5)
    assert_layout(out, RAGGED, 4, 5)


def test_the_builtin_and_hf_engines_agree_on_the_layout_and_on_greedy_tokens(engines):
    s = sampling(n=2, temperature=0.0, max_new_tokens=6)
    ours, theirs = engines["builtin-hf"].generate(RAGGED, s, seed=0), engines["hf"].generate(RAGGED, s, seed=0)
    for out in (ours, theirs):
        assert_layout(out, RAGGED, 2, 6)
    assert torch.equal(ours.tokens.offsets, theirs.tokens.offsets) and torch.equal(ours.prompt_lens, theirs.prompt_lens)
    assert torch.equal(ours.tokens.values, theirs.tokens.values)
    assert torch.equal(ours.loss_mask.values, theirs.loss_mask.values)
    torch.testing.assert_close(ours.logprobs.values, theirs.logprobs.values, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["builtin", "builtin-hf", "hf"])
def test_greedy_a_ragged_batch_generates_what_each_prompt_alone_does(engines, name):
    assert_batch_equals_alone(engines[name], RAGGED, sampling(n=2, temperature=0.0, max_new_tokens=6), atol=1e-4)


@pytest.mark.parametrize("name", ["builtin", "builtin-hf", "hf"])
def test_the_pad_id_changes_no_token_and_no_logprob(engines, name):
    for temperature in (0.0, 1.0):
        base = engines[name].generate(RAGGED, sampling(temperature=temperature), seed=7)
        for pad in (EOS, 1, 0):  # pads that are real tokens: still never attended
            other = engines[name].generate(RAGGED, sampling(temperature=temperature, pad_id=pad), seed=7)
            assert torch.equal(other.tokens.values, base.tokens.values), f"pad_id={pad} changed tokens"
            assert torch.equal(other.tokens.offsets, base.tokens.offsets)
            assert torch.equal(other.logprobs.values, base.logprobs.values), f"pad_id={pad} changed log-probs"


@pytest.mark.parametrize("name", ["builtin", "builtin-hf", "hf"])
def test_a_prompt_too_long_for_the_context_or_an_empty_one_is_refused_before_generating(engines, name):
    engine, context = engines[name], 64  # TINY's max_seq_len, the tiny Llama's max_position_embeddings
    with pytest.raises(ValueError, match=rf"prompt 1 has 60 tokens, more than the 59 that fit: the model's context "
                                         rf"of {context} tokens .* minus max_new_tokens=5.*lower max_new_tokens"):
        engine.generate(too_long(5, context), sampling(), seed=0)
    with pytest.raises(ValueError, match="max_new_tokens=64 leaves no room for a prompt"):
        engine.generate(RAGGED, sampling(max_new_tokens=64), seed=0)
    with pytest.raises(ValueError, match=r"prompt 2 is empty .* at least one token"):
        engine.generate(Ragged.from_sequences([[12, 1], [12, 2], []]), sampling(), seed=0)
    with pytest.raises(ValueError, match="prompt 1 holds token id 99, outside the model's vocabulary"):
        engine.generate(Ragged.from_sequences([[12, 1], [12, 99]]), sampling(), seed=0)
    fits = Ragged.from_sequences([[12, 1], [1] * 59])  # exactly at the limit: fine
    assert_layout(engine.generate(fits, sampling(n=1), seed=0), fits, 1, 5)


# hf ------------------------------------------------------------------------------------------
def test_hf_engine_logprobs_are_what_the_trainer_recomputes(hf_engine, hf_model):
    s = sampling(temperature=0.8, max_new_tokens=6)
    out = hf_engine.generate(RAGGED, s, seed=5)
    assert_layout(out, RAGGED, 4, 6)
    policy = build_model(hf_model).eval()
    torch.testing.assert_close(out.logprobs.values, recompute(policy, out, 0.8), atol=1e-4, rtol=0)
    assert torch.equal(hf_engine.generate(RAGGED, s, seed=5).tokens.values, out.tokens.values)  # seeded
    assert not torch.equal(hf_engine.generate(RAGGED, s, seed=6).tokens.values, out.tokens.values)


def test_hf_engine_stops_at_extra_stop_tokens(hf_engine):
    stops = tuple(range(10))  # every digit ends a response
    out = hf_engine.generate(RAGGED, sampling(max_new_tokens=6, stop_token_ids=stops), seed=0)
    assert_layout(out, RAGGED, 4, 6, stops=(EOS, *stops))


def test_hf_engine_given_no_prompts_returns_no_samples(hf_engine):
    out = hf_engine.generate(Ragged.from_sequences([], "int64"), sampling(), seed=0)
    assert out.num_samples == 0 and out.tokens.total == 0


def test_the_example_tokenizer_speaks_the_task_vocabulary_and_has_a_chat_template(tiny_llama):
    from flowrl.models.hf import chat_prompt_ids, check_task_vocabulary, load_tokenizer

    tok = load_tokenizer(tiny_llama)
    check_task_vocabulary(tok)
    assert tok.encode("^R4183=", add_special_tokens=False) == encode("^R4183=")
    assert chat_prompt_ids(tok, [{"role": "user", "content": "R4183="}]) == encode("^R4183=")
    assert tok.decode(encode("3814$"), skip_special_tokens=True) == "3814"
