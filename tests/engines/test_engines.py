"""The rollout engine seam without vLLM: the factory, the built-in and Hugging Face engines, the
batch layout every engine produces, weights in, and the tokenizer the example model ships with."""

from __future__ import annotations

import pytest
import torch

from flowrl.engines import Sampling, build_engine, parse_engine_spec
from flowrl.engines.base import pack_completions
from flowrl.models import build_model, generate, token_logprobs
from flowrl.tasks import EOS, PAD, build_task, encode

TINY = {"type": "tiny", "d_model": 32, "n_layers": 1, "n_heads": 2}
PROMPTS = build_task({"name": "reverse", "digits": 4}).prompts(0, 0, 3)[0]  # [3, 7]


def sampling(**kw):
    return Sampling(**{"n": 4, "temperature": 1.0, "max_new_tokens": 5, "eos_id": EOS, "pad_id": PAD, **kw})


def assert_layout(out, n_rows, p_len, t_len, stops=(EOS,)):
    assert out.tokens.shape == (n_rows, p_len + t_len) and out.tokens.dtype == torch.long
    assert out.response_mask.shape == out.logprobs.shape == (n_rows, t_len)
    assert out.logprobs.dtype == torch.float32
    assert torch.equal(out.tokens[:, :p_len], PROMPTS.repeat_interleave(n_rows // PROMPTS.shape[0], 0))
    resp, mask = out.responses, out.response_mask
    for r in range(n_rows):
        k = int(mask[r].sum())
        assert mask[r, :k].all() and not mask[r, k:].any()  # a prefix
        assert (resp[r, k:] == PAD).all() and (out.logprobs[r, k:] == 0).all()
        ends = [int(x) in stops for x in resp[r, :k]]
        assert not any(ends[:-1]) and (ends[-1] or k == t_len) if k else True


def test_builtin_engine_samples_exactly_what_flowrls_sampler_did_for_the_same_seed():
    engine = build_engine({"type": "builtin"}, model=TINY, seed=3)
    out = engine.generate(PROMPTS, sampling(), seed=11)
    policy = build_model(TINY, seed=3).eval()
    want = generate(policy, PROMPTS.repeat_interleave(4, 0), max_new_tokens=5, temperature=1.0, eos_id=EOS,
                    pad_id=PAD, generator=torch.Generator().manual_seed(11))
    assert torch.equal(out.tokens, want.tokens) and torch.equal(out.logprobs, want.logprobs)
    assert_layout(out, 12, 7, 5)


def test_builtin_engine_generates_from_the_tensors_the_runtime_writes_into():
    engine = build_engine({"type": "builtin"}, model=TINY, seed=0)
    other = build_model(TINY, seed=1).state_dict()
    live = engine.weights()
    for name, tensor in other.items():  # what the runtime does: receive into the live tensors
        live[name].copy_(tensor)
    engine.load_weights(live.items(), version=1)
    fresh = build_engine({"type": "builtin"}, model=TINY, seed=1)
    assert torch.equal(engine.generate(PROMPTS, sampling(), seed=0).tokens, fresh.generate(PROMPTS, sampling(), seed=0).tokens)
    engine.load_weights(build_model(TINY, seed=0).state_dict().items(), version=2)  # a loader callback
    assert engine.version == 2 and torch.equal(engine.weights()["tok_emb.weight"], build_model(TINY, seed=0).tok_emb.weight)
    with pytest.raises(KeyError, match="not a parameter of the rollout model"):
        engine.load_weights([("nope.weight", torch.zeros(1))], version=3)


def test_an_unknown_engine_or_a_tiny_model_under_vllm_is_a_clear_error():
    with pytest.raises(ValueError, match="choose one of builtin, hf, vllm"):
        parse_engine_spec({"type": "sglang"})
    with pytest.raises(ValueError, match="Extra inputs"):
        parse_engine_spec({"type": "vllm", "gpu_mem": 0.3})
    with pytest.raises(ValueError, match=r"runs a Hugging Face checkpoint.*make_model.py"):
        build_engine({"type": "vllm"}, model=TINY)


def test_pack_completions_cuts_after_the_first_stop_and_pads():
    out = pack_completions(PROMPTS[:1], [([3, EOS, 4], [-1.0, -2.0, -3.0]), ([1, 2], [-0.5, -0.5])],
                           sampling(n=2, max_new_tokens=4))
    assert out.response_mask.tolist() == [[True, True, False, False], [True, True, False, False]]
    assert out.responses.tolist() == [[3, EOS, PAD, PAD], [1, 2, PAD, PAD]]
    assert out.logprobs.tolist() == [[-1.0, -2.0, 0.0, 0.0], [-0.5, -0.5, 0.0, 0.0]]


def test_hf_engine_fills_the_same_layout_with_logprobs_the_trainer_recomputes(tiny_llama):
    model = {"type": "hf", "path": tiny_llama}
    engine = build_engine({"type": "hf"}, model=model)
    s = sampling(temperature=0.8, max_new_tokens=6)
    out = engine.generate(PROMPTS, s, seed=5)
    assert_layout(out, 12, 7, 6)
    policy = build_model(model).eval()
    recomputed = token_logprobs(policy, out.tokens, 7, temperature=0.8) * out.response_mask
    torch.testing.assert_close(out.logprobs, recomputed, atol=1e-4, rtol=0)
    assert torch.equal(engine.generate(PROMPTS, s, seed=5).tokens, out.tokens)  # seeded
    assert not torch.equal(engine.generate(PROMPTS, s, seed=6).tokens, out.tokens)


def test_hf_engine_stops_at_extra_stop_tokens(tiny_llama):
    engine = build_engine({"type": "hf"}, model={"type": "hf", "path": tiny_llama})
    stops = tuple(range(10))  # every digit ends a response
    out = engine.generate(PROMPTS, sampling(max_new_tokens=6, stop_token_ids=stops), seed=0)
    assert_layout(out, 12, 7, 6, stops=(EOS, *stops))


def test_the_example_tokenizer_speaks_the_task_vocabulary_and_has_a_chat_template(tiny_llama):
    from flowrl.models.hf import chat_prompt_ids, check_task_vocabulary, load_tokenizer

    tok = load_tokenizer(tiny_llama)
    check_task_vocabulary(tok)
    assert tok.encode("^R4183=", add_special_tokens=False) == encode("^R4183=")
    assert chat_prompt_ids(tok, [{"role": "user", "content": "R4183="}]) == encode("^R4183=")
    assert tok.decode(encode("3814$"), skip_special_tokens=True) == "3814"
