"""Sampling with a KV cache, and the per-token quantities RL needs, for any :class:`CausalLM`.

    >>> out = generate(policy, prompts, max_new_tokens=5, temperature=1.0, eos_id=EOS, pad_id=PAD,
    ...                generator=torch.Generator().manual_seed(0))        # doctest: +SKIP
    >>> out.tokens.shape, out.response_mask.shape, out.logprobs.shape     # doctest: +SKIP
    (torch.Size([B, P + 5]), torch.Size([B, 5]), torch.Size([B, 5]))
    >>> torch.allclose(out.logprobs, token_logprobs(policy, out.tokens, P), atol=1e-5)  # doctest: +SKIP
    True

Indexing convention used across flowrl: response position ``t`` (0-based) is token
``tokens[:, P + t]``; its log-prob, entropy and value are all read from the model output at
position ``P + t - 1``, the state the token was chosen in.

Log-probs are those of the temperature-scaled distribution, *before* top-p truncation (as verl and
OpenRLHF do): the trainer recomputes exactly the same quantity with :func:`token_logprobs`, so
the PPO ratio is 1 on the first mini-batch when nothing changed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flowrl.models.base import CausalLM


class Generation(NamedTuple):
    """What :func:`generate` returns."""

    tokens: torch.Tensor
    """``[B, P + T]`` int64: prompt, then response; ``pad_id`` after each EOS."""
    response_mask: torch.Tensor
    """``[B, T]`` bool: True for generated tokens up to and including the first EOS."""
    logprobs: torch.Tensor
    """``[B, T]`` float32: log-prob of each sampled token (0 where the mask is False)."""

    @property
    def responses(self) -> torch.Tensor:
        """``[B, T]`` the response part of ``tokens``."""
        return self.tokens[:, self.tokens.shape[1] - self.response_mask.shape[1] :]


def _sample(logp: torch.Tensor, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    # logp [B, V] (already temperature-scaled) -> sampled ids [B]
    probs = logp.exp()
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # drop a token once the mass before it already reaches top_p; the top token always stays
        drop = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: CausalLM,
    prompts: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    eos_id: int,
    pad_id: int | None = None,
    generator: torch.Generator | None = None,
) -> Generation:
    """Sample up to ``max_new_tokens`` per prompt (``prompts [B, P]``, equal lengths, no padding).

    ``temperature <= 0`` is greedy decoding (log-probs then of the unscaled distribution). The same
    ``generator`` state gives the same tokens: every random draw goes through it. Stops early once
    every row has emitted EOS; the result is still padded to ``max_new_tokens``.
    """
    if prompts.dim() != 2 or prompts.shape[1] == 0:
        raise ValueError(f"prompts must be a non-empty [B, P] int64 tensor, got shape {tuple(prompts.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    pad = eos_id if pad_id is None else pad_id
    device = _device(model)
    prompts = prompts.to(device)
    b, p = prompts.shape
    tokens = torch.full((b, p + max_new_tokens), pad, dtype=torch.long, device=device)
    tokens[:, :p] = prompts
    mask = torch.zeros(b, max_new_tokens, dtype=torch.bool, device=device)
    logprobs = torch.zeros(b, max_new_tokens, dtype=torch.float32, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    cache = model.new_cache(b, p + max_new_tokens)
    logits = model.forward_cached(prompts, cache, 0)[:, -1]
    for t in range(max_new_tokens):
        if temperature > 0:
            logp = torch.log_softmax(logits.float() / temperature, dim=-1)
            tok = _sample(logp, top_p, generator)
        else:
            logp = torch.log_softmax(logits.float(), dim=-1)
            tok = logp.argmax(dim=-1)
        live = ~done
        tok = torch.where(live, tok, pad)
        tokens[:, p + t] = tok
        mask[:, t] = live
        logprobs[:, t] = torch.where(live, logp.gather(-1, tok[:, None]).squeeze(-1), 0.0)
        done = done | (tok == eos_id)
        if t + 1 == max_new_tokens or bool(done.all()):
            break
        logits = model.forward_cached(tok[:, None], cache, p + t)[:, -1]
    return Generation(tokens, mask, logprobs)


def _device(model: CausalLM) -> torch.device:
    return next(model.parameters()).device


def _response_logits(model: CausalLM, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
    if model.has_value_head:
        raise TypeError("log-probs need a policy; this model has a value head (a critic)")
    if not 0 < prompt_len < tokens.shape[1]:
        raise ValueError(f"prompt_len must be in 1..{tokens.shape[1] - 1} for tokens of shape {tuple(tokens.shape)}")
    return model(tokens.to(_device(model)))[:, prompt_len - 1 : -1].float()  # [B, T, V]


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[label]`` per position: ``[..., V]``, ``[...]`` -> ``[...]``."""
    return torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` per position: ``[..., V]`` -> ``[...]``."""
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def token_logprobs(
    model: CausalLM, tokens: torch.Tensor, prompt_len: int, *, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probs ``[B, T]`` of ``tokens[:, prompt_len:]`` under ``model``; differentiable.

    Positions after EOS get meaningless values: multiply by (or mask with) the response mask.
    """
    logits = _response_logits(model, tokens, prompt_len)
    if temperature > 0:
        logits = logits / temperature
    return logprobs_from_logits(logits, tokens[:, prompt_len:].to(logits.device))


def token_logprobs_and_entropy(
    model: CausalLM, tokens: torch.Tensor, prompt_len: int, *, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`token_logprobs`, plus the entropy ``[B, T]`` of each position's distribution."""
    logits = _response_logits(model, tokens, prompt_len)
    if temperature > 0:
        logits = logits / temperature
    return logprobs_from_logits(logits, tokens[:, prompt_len:].to(logits.device)), entropy_from_logits(logits)


def values(model: CausalLM, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Values ``[B, T]``: ``V(state before response token t)``, from a value-head model; differentiable."""
    if not model.has_value_head:
        raise TypeError("values need a critic: build the model with value_head=True")
    if not 0 < prompt_len < tokens.shape[1]:
        raise ValueError(f"prompt_len must be in 1..{tokens.shape[1] - 1} for tokens of shape {tuple(tokens.shape)}")
    return model(tokens.to(_device(model)))[:, prompt_len - 1 : -1].float()
