"""Batches for the trainer tests: ragged rollouts, their legacy rectangular form, random long-tailed batches.

``sample`` returns the ragged ``Generation`` (tokens, loss mask, log-probs aligned) whichever form
``flowrl.models.generate`` returns (the rectangular one before the models change, the ragged one
after): the tests run on both. ``PackedTinyLM`` is the tiny model with a packed kernel of its own
(``forward_packed`` overridden), as a backend that has one looks to the trainers and to FSDP.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flowrl.models import generate
from flowrl.models.generation import Generation
from flowrl.models.packing import packed_logprobs
from flowrl.models.tiny import TinyLM
from flowrl.rl.tokens import to_rect
from flowrl.tasks import EOS, PAD
from flowrl.transport.ragged import Ragged


def as_ragged(gen, prompts: torch.Tensor) -> Generation:
    """The ragged Generation of a rectangular one (``generate``'s form before the models change)."""
    if isinstance(gen.tokens, Ragged):
        return gen
    p = Ragged.from_padded(prompts, torch.full((prompts.shape[0],), prompts.shape[1]))
    return Generation.from_grids(p, gen.responses, gen.response_mask, gen.logprobs, n=1)


def sample(model, prompts: torch.Tensor, *, max_new_tokens: int, seed: int, **kw) -> Generation:
    gen = generate(model, prompts, max_new_tokens=max_new_tokens, eos_id=EOS, pad_id=PAD,
                   generator=torch.Generator().manual_seed(seed), **kw)
    return as_ragged(gen, prompts)


def as_rect(gen: Generation) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens [B, P+T], response_mask [B, T], logprobs [B, T])`` of a Generation whose prompts share a length."""
    p = int(gen.prompt_lens[0])
    assert bool((gen.prompt_lens == p).all())
    responses = gen.responses(pad=PAD)
    t = responses.shape[1]
    prompts = gen.tokens.to_padded(PAD)[:, :p]
    mask = torch.arange(t)[None] < gen.response_lens[:, None]
    return torch.cat([prompts, responses], dim=1), mask, to_rect(gen.logprobs, p, t)


class Rect(NamedTuple):
    """A rollout in the legacy rectangular form (what ``generate`` returned before the models change)."""

    tokens: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor


def sample_rect(model, prompts: torch.Tensor, *, max_new_tokens: int, seed: int, **kw) -> Rect:
    return Rect(*as_rect(sample(model, prompts, max_new_tokens=max_new_tokens, seed=seed, **kw)))


def random_batch(model, n: int, *, seed: int, prompt=(2, 5), response=(1, 10), holes: bool = False,
                 vocab: int = 18) -> dict:
    """``n`` sequences of random tokens: prompts of ``prompt`` tokens, responses long-tailed in ``response``;
    loss mask on the responses (with ``holes``, a masked-out token in some: multi-turn), old log-probs the
    model's own plus noise, per-token advantages and reference log-probs, per-sequence scores and returns."""
    g = torch.Generator().manual_seed(seed)
    p_lens = torch.randint(prompt[0], prompt[1] + 1, (n,), generator=g)
    u = torch.rand(n, generator=g)
    r_lens = (response[0] + (response[1] - response[0]) * u**3).round().long()  # most short, a few long
    lens = p_lens + r_lens
    tokens = Ragged.from_sequences([torch.randint(0, vocab, (int(k),), generator=g) for k in lens])
    pos = torch.arange(tokens.total) - tokens.offsets[:-1].repeat_interleave(lens)
    mask = pos >= p_lens.repeat_interleave(lens)
    if holes:
        mask &= ~((pos == p_lens.repeat_interleave(lens) + 1) & (r_lens.repeat_interleave(lens) > 3))
    m = mask.float()
    old = packed_logprobs(model, tokens).values + 0.05 * torch.randn(tokens.total, generator=g)
    return {
        "tokens": tokens,
        "loss_mask": tokens.like(mask),
        "old_logprobs": tokens.like(old * m),
        "advantages": tokens.like(torch.randn(tokens.total, generator=g) * m),
        "seq_advantages": torch.randn(n, generator=g),
        "ref_logprobs": tokens.like((old + 0.1 * torch.randn(tokens.total, generator=g)) * m),
        "returns": tokens.like(torch.rand(tokens.total, generator=g) * m),
        "scores": torch.rand(n, generator=g),
    }


class PackedTinyLM(TinyLM):
    """The tiny model with its own ``forward_packed`` (right-pads, one ``forward``, unpads): a backend
    with a packed kernel, as the trainers and FSDP see one (registered as a forward method)."""

    def forward_packed(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        lens = cu_seqlens[1:] - cu_seqlens[:-1]
        real = torch.arange(int(lens.max()), device=tokens.device)[None] < lens[:, None]
        padded = torch.zeros(real.shape, dtype=tokens.dtype, device=tokens.device)
        padded[real] = tokens
        return self.forward(padded)[real]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def comparable(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state without the key third of each ``qkv.bias``: its exact gradient is zero (softmax ignores a
    constant added to every key), so Adam turns rounding noise there into steps of ~lr in any two runs
    that sum in another order; it is checked apart, as noise (see tests/rl/test_data_parallel.py)."""
    out = {}
    for k, v in state.items():
        if k.endswith("attn.qkv.bias"):
            q, key, val = v.chunk(3)
            out[k] = torch.cat([q, val])
            out[k + "[key]"] = key
        else:
            out[k] = v
    return out


def assert_same_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float = 1e-5) -> None:
    got, want = comparable(got), comparable(want)
    assert got.keys() == want.keys()
    for k in want:
        if k.endswith("[key]"):
            assert float(got[k].abs().max()) < 1e-3 and float(want[k].abs().max()) < 1e-3
            continue
        err = relative_error(got[k], want[k])
        assert err < tol, f"{k} differs by {err:.2e} relative"
