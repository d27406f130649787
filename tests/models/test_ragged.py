"""Sequences of their own length, end to end, on the built-in model and the HF adapter: packed
compute equals each sequence alone, no pad is ever attended to, and a left-padded KV cache decodes
each row as it decodes alone."""

from __future__ import annotations

import pytest
import torch

from flowrl.models import TinyLMSpec, build_model, generate
from flowrl.models.packing import packed_logprobs, packed_values
from flowrl.tasks import EOS, PAD, VOCAB_SIZE
from flowrl.transport.ragged import Ragged

SPEC = TinyLMSpec(d_model=32, n_layers=2, n_heads=4, max_seq_len=40)
LENGTHS = (5, 1, 9, 3, 12, 7)
BACKENDS = ["learned", "rope", "hf", "hf-eager", "hf-gpt2"]
HF_DIRS = {"hf": "hf_model_dir", "hf-eager": "hf_model_dir", "hf-gpt2": "hf_gpt2_dir"}


def _model(kind: str, request, *, value_head: bool = False):
    """A policy or critic of backend ``kind``, in eval mode; a critic gets a random value head
    (the real one starts at zero, which would make every value comparison trivially true)."""
    if kind in HF_DIRS:
        pytest.importorskip("transformers")
        spec = {"type": "hf", "path": request.getfixturevalue(HF_DIRS[kind])}
        if kind == "hf-eager":  # the default is sdpa; eager adds a float mask instead of a bool one
            spec["attn_implementation"] = "eager"
        model = build_model(spec, value_head=value_head)
    else:
        model = build_model(SPEC.model_copy(update={"positions": kind}), value_head=value_head, seed=0)
    if value_head:
        with torch.no_grad():
            model.value_head.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(1))
            model.value_head.bias.fill_(0.3)
    return model.eval()


def _sequences(lengths=LENGTHS, seed: int = 0) -> Ragged:
    g = torch.Generator().manual_seed(seed)
    return Ragged.from_sequences([torch.randint(0, VOCAB_SIZE, (n,), generator=g) for n in lengths])


def _alone_logprobs(model, seq: torch.Tensor) -> torch.Tensor:
    """Aligned log-probs of one sequence run alone: entry j from the output at j - 1, 0 at j = 0."""
    logp = torch.log_softmax(model(seq[None])[0].float(), dim=-1)
    out = torch.zeros(len(seq))
    out[1:] = logp[:-1].gather(-1, seq[1:, None]).squeeze(-1)
    return out


def _other_pad(pad: int) -> int:
    return (pad + 5) % VOCAB_SIZE


# ----------------------------------------------------------------------------------- packed compute
@pytest.mark.parametrize("kind", BACKENDS)
@torch.no_grad()
def test_packed_logprobs_equal_each_sequence_alone(kind, request):
    model = _model(kind, request)
    seqs = _sequences()
    alone = torch.cat([_alone_logprobs(model, s) for s in seqs])
    for budget in (None, 16):  # one micro-batch of everything, and several
        packed = packed_logprobs(model, seqs, max_tokens=budget)
        assert packed.aligned(seqs)
        torch.testing.assert_close(packed.values, alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", BACKENDS)
@torch.no_grad()
def test_packed_values_equal_each_sequence_alone(kind, request):
    critic = _model(kind, request, value_head=True)
    seqs = _sequences()
    direct = critic.forward_packed(seqs.values, seqs.offsets)
    assert direct.shape == (seqs.total,)
    torch.testing.assert_close(direct, torch.cat([critic(s[None])[0] for s in seqs]), atol=1e-5, rtol=0)
    alone = []
    for s in seqs:
        v = torch.zeros(len(s))
        v[1:] = critic(s[None])[0, :-1]
        alone.append(v)
    torch.testing.assert_close(packed_values(critic, seqs, max_tokens=16).values, torch.cat(alone), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", BACKENDS)
@torch.no_grad()
def test_forward_packed_logits_equal_each_sequence_alone_and_skip_empty_sequences(kind, request):
    model = _model(kind, request)
    seqs = _sequences((4, 0, 6, 1, 0))
    got = model.forward_packed(seqs.values, seqs.offsets)
    assert got.shape == (seqs.total, model.vocab_size)
    want = torch.cat([model(s[None])[0] for s in seqs if len(s)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_tiny_packed_sequences_of_few_lengths_batched_by_length_equal_each_alone_with_gradients(positions):
    model = build_model(SPEC.model_copy(update={"positions": positions}), seed=0)
    seqs = _sequences((5, 3, 5, 5, 0, 3, 5, 3))  # 7 sequences of 2 lengths: one attention call per length
    got = model.forward_packed(seqs.values, seqs.offsets)
    got.logsumexp(-1).sum().backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    want = torch.cat([model(s[None])[0] for s in seqs if len(s)])
    want.logsumexp(-1).sum().backward()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for n, g in packed.items():
        torch.testing.assert_close(g, model.get_parameter(n).grad, atol=1e-5, rtol=1e-5)


def test_tiny_packed_forward_is_differentiable():
    model = build_model(SPEC, seed=0)
    seqs = _sequences()
    model.forward_packed(seqs.values, seqs.offsets).logsumexp(-1).mean().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if not n.startswith("pos_emb"))


# ----------------------------------------------------------------------------------- no pad attended
@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("side", ["left", "right"])
@torch.no_grad()
def test_forward_with_a_mask_never_reads_the_pad_ids(kind, side, request):
    model = _model(kind, request)
    seqs = _sequences()
    mask = seqs.mask(side=side)
    outs = [model(seqs.to_padded(pad, side=side), attention_mask=mask) for pad in (PAD, _other_pad(PAD))]
    assert not any(o.isnan().any() for o in outs)  # pad queries too: each attends at least to itself
    assert torch.equal(outs[0][mask], outs[1][mask])  # bitwise: real positions never read a pad
    torch.testing.assert_close(outs[0][mask], torch.cat([model(s[None])[0] for s in seqs]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", BACKENDS)
@torch.no_grad()
def test_a_critic_with_a_mask_never_reads_the_pad_ids(kind, request):
    critic = _model(kind, request, value_head=True)
    seqs = _sequences()
    mask = seqs.mask(side="left")
    outs = [critic(seqs.to_padded(pad, side="left"), attention_mask=mask) for pad in (0, 7)]
    assert torch.equal(outs[0][mask], outs[1][mask]) and not outs[0].isnan().any()


@pytest.mark.parametrize("kind", BACKENDS)
def test_ragged_generation_does_not_depend_on_the_pad_id(kind, request):
    model = _model(kind, request)
    prompts = _sequences(seed=3)
    runs = [generate(model, prompts, max_new_tokens=6, eos_id=EOS, pad_id=pad,
                     generator=torch.Generator().manual_seed(0)) for pad in (PAD, _other_pad(PAD))]
    assert torch.equal(runs[0].tokens.offsets, runs[1].tokens.offsets)
    assert torch.equal(runs[0].tokens.values, runs[1].tokens.values)
    assert torch.equal(runs[0].logprobs.values, runs[1].logprobs.values)
    assert runs[0].prompt_lens.tolist() == list(LENGTHS)


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_ragged_batch_generates_what_each_prompt_generates_alone(kind, request):
    model = _model(kind, request)
    prompts = _sequences(seed=4)
    together = generate(model, prompts, max_new_tokens=6, temperature=0.0, eos_id=EOS, pad_id=PAD)
    for i, prompt in enumerate(prompts):
        alone = generate(model, prompt[None], max_new_tokens=6, temperature=0.0, eos_id=EOS, pad_id=PAD)
        assert torch.equal(alone.tokens.values, together.tokens[i])
        torch.testing.assert_close(alone.logprobs.values, together.logprobs[i], atol=1e-5, rtol=0)
        assert torch.equal(alone.loss_mask.values, together.loss_mask[i])


def test_a_legacy_prompt_grid_is_a_batch_of_full_rows():
    model = build_model(SPEC, seed=0)
    grid = torch.randint(0, VOCAB_SIZE, (4, 6), generator=torch.Generator().manual_seed(0))
    a = generate(model, grid, max_new_tokens=5, eos_id=EOS, pad_id=PAD, generator=torch.Generator().manual_seed(2))
    b = generate(model, Ragged.from_padded(grid, torch.full((4,), 6)), max_new_tokens=5, eos_id=EOS, pad_id=PAD,
                 generator=torch.Generator().manual_seed(2))
    assert torch.equal(a.tokens.values, b.tokens.values) and torch.equal(a.logprobs.values, b.logprobs.values)
    assert a.prompt_lens.tolist() == [6] * 4


def test_an_empty_prompt_is_refused():
    model = build_model(SPEC, seed=0)
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, Ragged.from_sequences([[1, 2], []]), max_new_tokens=3, eos_id=EOS)


# ----------------------------------------------------------------------------------- left-padded cache
@pytest.mark.parametrize("kind", BACKENDS)
def test_sampled_logprobs_of_a_ragged_batch_match_a_full_recomputation(kind, request):
    model = _model(kind, request)
    prompts = _sequences(seed=5)
    out = generate(model, prompts, max_new_tokens=8, temperature=0.8, eos_id=EOS, pad_id=PAD,
                   generator=torch.Generator().manual_seed(0))
    recomputed = packed_logprobs(model, out.tokens, temperature=0.8)
    torch.testing.assert_close(recomputed.values * out.loss_mask.values, out.logprobs.values, atol=1e-5, rtol=0)
    assert not out.loss_mask.values[torch.cat([torch.arange(int(o), int(o) + int(p))
                                              for o, p in zip(out.tokens.offsets[:-1], out.prompt_lens)])].any()


@pytest.mark.parametrize("kind", BACKENDS)
@torch.no_grad()
def test_a_left_padded_cache_fed_in_chunks_equals_the_masked_full_forward(kind, request):
    model = _model(kind, request)
    seqs = _sequences((6, 2, 9, 4), seed=6)
    prompt_w = 9
    tokens = seqs.to_padded(PAD, side="left")  # the "prompts": left-padded to 9 slots
    mask = seqs.mask(side="left")
    extra = torch.randint(0, VOCAB_SIZE, (4, 5), generator=torch.Generator().manual_seed(7))
    full_tokens = torch.cat([tokens, extra], dim=1)
    full_mask = torch.cat([mask, torch.ones(4, 5, dtype=torch.bool)], dim=1)
    full = model(full_tokens, attention_mask=full_mask)
    cache = model.new_cache(4, prompt_w + 5)
    parts = [model.forward_cached(tokens, cache, 0, mask), model.forward_cached(extra[:, :3], cache, prompt_w),
             model.forward_cached(extra[:, 3:4], cache, prompt_w + 3),
             model.forward_cached(extra[:, 4:], cache, prompt_w + 4)]
    got = torch.cat(parts, dim=1)
    torch.testing.assert_close(got[full_mask], full[full_mask], atol=1e-5, rtol=0)
    # and each row's real positions equal that row run alone, unpadded
    for i, s in enumerate(seqs):
        alone = model(torch.cat([s, extra[i]])[None])[0]
        torch.testing.assert_close(got[i][full_mask[i]], alone, atol=1e-5, rtol=0)
