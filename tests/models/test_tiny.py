"""The built-in transformer: seeded init, cached sampling equal to full recomputation, determinism."""

from __future__ import annotations

import pytest
import torch

from flowrl.models import (
    TinyLMSpec, build_model, generate, parse_model_spec, token_logprobs, token_logprobs_and_entropy, values,
)
from flowrl.models.packing import packed_logprobs
from flowrl.tasks import EOS, PAD, VOCAB_SIZE, build_task

SPEC = TinyLMSpec(d_model=32, n_layers=2, n_heads=4, max_seq_len=24)


def _prompts(n: int = 6) -> torch.Tensor:
    return build_task({"name": "reverse", "digits": 4}).prompts(0, 0, n)[0]


def _grid(out, p: int):
    """The rectangular view of a generation whose prompts all have ``p`` tokens: tokens
    ``[B, P + T]`` (``PAD`` after each response), response mask and log-probs ``[B, T]``."""
    return (out.tokens.to_padded(PAD), out.loss_mask.to_padded(False)[:, p:], out.logprobs.to_padded(0.0)[:, p:])


def _eos_prone(model):
    """Make every position's distribution favour EOS, so rows stop at different steps."""
    with torch.no_grad():
        model.norm.weight.zero_()
        model.norm.bias.zero_()
        model.norm.bias[0] = 1.0  # every hidden state becomes e_0, logits = lm_head.weight[:, 0]
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[EOS, 0] = 1.5
    return model


def test_the_default_vocabulary_is_the_task_vocabulary():
    assert TinyLMSpec().vocab_size == VOCAB_SIZE


def test_same_seed_builds_bitwise_equal_weights_and_the_critic_trunk_equals_the_policy():
    a, b = build_model(SPEC, seed=3), build_model(SPEC, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(build_model(SPEC, seed=4).tok_emb.weight, a.tok_emb.weight)
    critic = build_model(SPEC, value_head=True, seed=3)
    trunk = {k: v for k, v in a.state_dict().items() if not k.startswith("lm_head")}
    assert all(torch.equal(critic.state_dict()[k], v) for k, v in trunk.items())


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_cached_generation_gives_the_same_logprobs_as_a_full_forward(positions):
    model = build_model(SPEC.model_copy(update={"positions": positions}), seed=0)
    prompts = _prompts()
    out = generate(model, prompts, max_new_tokens=8, eos_id=EOS, pad_id=PAD,
                   generator=torch.Generator().manual_seed(0))
    packed = packed_logprobs(model, out.tokens)
    torch.testing.assert_close(packed.values * out.loss_mask.values, out.logprobs.values, atol=1e-5, rtol=0)
    tokens, mask, logprobs = _grid(out, prompts.shape[1])  # the legacy rectangular helper agrees
    full = token_logprobs(model, tokens, prompts.shape[1])
    torch.testing.assert_close(full * mask, logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_a_multi_token_chunk_after_the_prompt_sees_the_cache_causally(positions):
    model = build_model(SPEC.model_copy(update={"positions": positions}), seed=1).eval()
    tokens = torch.randint(0, VOCAB_SIZE, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(3, 12)
        parts = [model.forward_cached(tokens[:, :5], cache, 0), model.forward_cached(tokens[:, 5:9], cache, 5),
                 model.forward_cached(tokens[:, 9:], cache, 9)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("positions", ["learned", "rope"])
@pytest.mark.parametrize("num_slots,where", [(4, [2, 0, 3]), (16, [9, 0, 15])])  # a window of the rows; rows gathered
def test_slots_hold_sequences_of_their_own_lengths_that_never_see_each_other(positions, num_slots, where):
    model = build_model(SPEC.model_copy(update={"positions": positions}), seed=1).eval()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, VOCAB_SIZE, (n,), generator=g) for n in (5, 9, 3)]
    slots, prompt = torch.tensor(where), [4, 6, 3]
    cache = model.new_slot_cache(num_slots, 12)
    with torch.no_grad():
        full = [model(seq[None])[0] for seq in seqs]
        for k in range(num_slots):  # garbage in every slot first: a slot's old contents must not matter
            cache.keys[k % 2][k].normal_(generator=g)
        pads = torch.full((3, 6), PAD)
        for i, n in enumerate(prompt):
            pads[i, :n] = seqs[i][:n]
        last = model.forward_slots(pads, cache, slots, torch.zeros(3, dtype=torch.int64),
                                   last=torch.tensor(prompt) - 1)  # right-padded prefill
        torch.testing.assert_close(last, torch.stack([full[i][n - 1] for i, n in enumerate(prompt)]),
                                   atol=1e-5, rtol=0)
        lens = list(prompt)
        while any(n < len(s) for n, s in zip(lens, seqs)):  # decode: each row one token at its own position
            rows = [i for i, s in enumerate(seqs) if lens[i] < len(s)]
            tokens = torch.tensor([[seqs[i][lens[i]]] for i in rows])
            out = model.forward_slots(tokens, cache, slots[rows], torch.tensor([lens[i] for i in rows]))
            torch.testing.assert_close(out[:, 0], torch.stack([full[i][lens[i]] for i in rows]), atol=1e-5, rtol=0)
            for i in rows:
                lens[i] += 1
    with pytest.raises(ValueError, match="slot length 12"):
        model.forward_slots(torch.zeros(1, 1, dtype=torch.int64), cache, torch.tensor([0]), torch.tensor([12]))


def test_generation_is_deterministic_under_a_seeded_generator():
    model = build_model(SPEC, seed=0)
    runs = [generate(model, _prompts(), max_new_tokens=6, eos_id=EOS, generator=torch.Generator().manual_seed(s))
            for s in (5, 5, 6)]
    assert torch.equal(runs[0].tokens.values, runs[1].tokens.values)
    assert torch.equal(runs[0].logprobs.values, runs[1].logprobs.values)
    assert not torch.equal(runs[0].responses(PAD), runs[2].responses(PAD))


def test_a_response_ends_at_its_first_eos_and_nothing_comes_after():
    model = _eos_prone(build_model(SPEC, seed=0))
    out = generate(model, _prompts(32), max_new_tokens=6, eos_id=EOS, pad_id=PAD,
                   generator=torch.Generator().manual_seed(0))
    lengths = out.response_lens
    assert len(set(lengths.tolist())) > 1  # rows did stop at different steps
    assert out.loss_mask.aligned(out.tokens) and out.logprobs.aligned(out.tokens)
    for i in range(out.num_samples):
        p, n = int(out.prompt_lens[i]), int(lengths[i])
        resp, mask, lp = out.tokens[i][p:], out.loss_mask[i], out.logprobs[i]
        assert 1 <= n <= 6 and len(resp) == n
        assert not mask[:p].any() and mask[p:].all() and (lp[:p] == 0).all() and (lp[p:] < 0).all()
        eos = (resp == EOS).nonzero().flatten().tolist()
        assert eos in ([], [n - 1]) and (eos or n == 6)  # ends at its only EOS, or at the budget
    grid = out.responses(PAD)
    assert grid.shape == (32, int(lengths.max()))
    assert all((row[n:] == PAD).all() for row, n in zip(grid, lengths.tolist()))


def test_greedy_and_tiny_top_p_both_pick_the_most_likely_token():
    model = build_model(SPEC, seed=2)
    greedy = generate(model, _prompts(), max_new_tokens=5, temperature=0.0, eos_id=EOS)
    nucleus = generate(model, _prompts(), max_new_tokens=5, top_p=1e-6, eos_id=EOS,
                       generator=torch.Generator().manual_seed(0))
    assert torch.equal(greedy.tokens.values, nucleus.tokens.values)
    assert torch.equal(greedy.tokens.offsets, nucleus.tokens.offsets)


def test_temperature_scales_the_recomputed_logprobs_the_same_way():
    model = build_model(SPEC, seed=0)
    out = generate(model, _prompts(), max_new_tokens=5, temperature=0.7, eos_id=EOS, pad_id=PAD,
                   generator=torch.Generator().manual_seed(1))
    tokens, mask, logprobs = _grid(out, 7)
    lp, ent = token_logprobs_and_entropy(model, tokens, 7, temperature=0.7)
    torch.testing.assert_close(lp * mask, logprobs, atol=1e-5, rtol=0)
    assert ent.shape == lp.shape and float(ent.detach().min()) >= 0.0
    packed = packed_logprobs(model, out.tokens, temperature=0.7)
    torch.testing.assert_close(packed.values * out.loss_mask.values, out.logprobs.values, atol=1e-5, rtol=0)


def test_an_untrained_policy_is_close_to_uniform():
    model = build_model(SPEC, seed=0)
    out = generate(model, _prompts(), max_new_tokens=5, eos_id=EOS, pad_id=PAD)
    _, ent = token_logprobs_and_entropy(model, _grid(out, 7)[0], 7)
    assert float(ent.detach().mean()) > 0.95 * torch.log(torch.tensor(float(VOCAB_SIZE)))


def test_values_come_one_per_response_token_and_only_from_a_critic():
    critic = build_model(SPEC, value_head=True, seed=0)
    tokens = torch.randint(0, VOCAB_SIZE, (4, 12))
    v = values(critic, tokens, prompt_len=7)
    assert v.shape == (4, 5) and torch.equal(v, torch.zeros(4, 5))  # zero-initialised head
    with pytest.raises(TypeError, match="value_head=True"):
        values(build_model(SPEC), tokens, 7)
    with pytest.raises(TypeError, match="critic"):
        token_logprobs(critic, tokens, 7)


def test_sequences_longer_than_max_seq_len_are_refused_with_the_fix():
    model = build_model(SPEC, seed=0)
    with pytest.raises(ValueError, match="max_seq_len=24"):  # at once, before any row could stop
        generate(model, _prompts(), max_new_tokens=20, eos_id=EOS)
    with pytest.raises(ValueError, match="max_seq_len=24"):
        model(torch.zeros(1, 25, dtype=torch.long))
    with pytest.raises(ValueError, match="max_seq_len=24"):
        model.forward_packed(torch.zeros(30, dtype=torch.long), torch.tensor([0, 5, 30]))


def test_bad_model_configs_are_rejected_with_the_reason():
    with pytest.raises(ValueError, match="tiny, hf"):
        parse_model_spec({"type": "gpt"})
    with pytest.raises(ValueError, match="d_modle"):
        parse_model_spec({"type": "tiny", "d_modle": 64})
    with pytest.raises(ValueError, match="must divide d_model"):
        TinyLMSpec(d_model=64, n_heads=5)


def test_tied_embeddings_share_one_tensor():
    model = build_model(SPEC.model_copy(update={"tie_embeddings": True}), seed=0)
    assert model.lm_head.weight is model.tok_emb.weight
