"""Sampling with a KV cache, and the per-token quantities RL needs, for any :class:`CausalLM`.

    >>> prompts = Ragged.from_sequences([[3, 1, 4], [1, 5], [9, 2, 6, 5]])   # each its own length
    >>> out = generate(policy, prompts, max_new_tokens=5, temperature=1.0, eos_id=EOS, pad_id=PAD,
    ...                generator=torch.Generator().manual_seed(0))        # doctest: +SKIP
    >>> out.tokens.lengths, out.prompt_lens                               # doctest: +SKIP
    (tensor([..]), tensor([3, 2, 4]))             # prompt + response per sample, nothing after the EOS
    >>> lp = packed_logprobs(policy, out.tokens)  # flowrl.models.packing    # doctest: +SKIP
    >>> torch.allclose(lp.values * out.loss_mask.values, out.logprobs.values, atol=1e-5)  # doctest: +SKIP
    True

:func:`generate` returns a ragged :class:`~flowrl.models.generation.Generation`. Prompts of different
lengths are decoded together, left-padded with ``pad_id`` behind an attention mask, so each row gets
what it gets alone and pad ids never matter. A legacy ``[B, P]`` tensor is a batch of full rows.

The rectangular helpers (:func:`token_logprobs`, :func:`token_logprobs_and_entropy`, :func:`values`)
read a ``[B, P + T]`` grid whose prompts all have ``P`` tokens: response position ``t`` (0-based) is
token ``tokens[:, P + t]``; its log-prob, entropy and value are all read from the model output at
position ``P + t - 1``, the state the token was chosen in.

Log-probs are those of the temperature-scaled distribution, *before* top-p truncation (as verl and
OpenRLHF do): the trainer recomputes exactly the same quantity, so the PPO ratio is 1 on the first
mini-batch when nothing changed.
"""

from __future__ import annotations

import torch

from flowrl.models.base import CausalLM
from flowrl.models.generation import Generation
from flowrl.transport.ragged import Ragged


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


def sample_next(logits: torch.Tensor, temperature: float, top_p: float,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens ``[B]`` from ``logits [B, V]`` and their log-probs ``[B]`` (temperature-scaled,
    before top-p; ``temperature <= 0``: greedy, log-probs of the unscaled distribution)."""
    if temperature > 0:
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        tok = _sample(logp, top_p, generator)
    else:
        logp = torch.log_softmax(logits.float(), dim=-1)
        tok = logp.argmax(dim=-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def _as_ragged(prompts: "Ragged | torch.Tensor") -> Ragged:
    """Prompts as a torch Ragged: a Ragged as it is, a ``[B, P]`` tensor as ``B`` full rows."""
    if isinstance(prompts, Ragged):
        prompts = prompts.to_torch()
        return Ragged(prompts.values.cpu(), prompts.offsets.cpu(), check=False)
    if not isinstance(prompts, torch.Tensor) or prompts.dim() != 2 or prompts.shape[1] == 0:
        shape = tuple(prompts.shape) if hasattr(prompts, "shape") else type(prompts).__name__
        raise ValueError(f"prompts must be a Ragged or a non-empty [B, P] int64 tensor, got {shape}")
    b, p = prompts.shape
    prompts = prompts.cpu()
    return Ragged(prompts.reshape(-1), torch.arange(b + 1, dtype=torch.int64) * p, check=False)


@torch.no_grad()
def generate(
    model: CausalLM,
    prompts: "Ragged | torch.Tensor",
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    eos_id: int,
    pad_id: int | None = None,
    generator: torch.Generator | None = None,
) -> Generation:
    """Sample up to ``max_new_tokens`` after each prompt; one sample per prompt (repeat prompts for more).

    ``prompts`` is a :class:`Ragged` (each prompt its own length, at least one token) or a legacy
    ``[B, P]`` tensor (all rows full). Internally prompts are left-padded with ``pad_id`` (default:
    ``eos_id``) behind an attention mask, so no pad is ever attended to. A response ends at its first
    ``eos_id`` (included) or after ``max_new_tokens``. ``temperature <= 0`` is greedy decoding
    (log-probs then of the unscaled distribution). The same ``generator`` state gives the same
    tokens: every random draw goes through it. Stops early once every row has emitted EOS.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    ragged = _as_ragged(prompts)
    lens = ragged.lengths
    if ragged.num_samples == 0 or bool((lens < 1).any()):
        raise ValueError(f"every prompt needs at least one token; got {ragged.num_samples} prompts with lengths "
                         f"{lens.tolist()[:8]}")
    pad = eos_id if pad_id is None else pad_id
    device = _device(model)
    b, width = ragged.num_samples, int(lens.max())
    padded = ragged.to_padded(pad, side="left").to(device=device, dtype=torch.long)
    prompt_mask = ragged.mask(side="left").to(device)
    responses = torch.full((b, max_new_tokens), pad, dtype=torch.long, device=device)
    mask = torch.zeros(b, max_new_tokens, dtype=torch.bool, device=device)
    logprobs = torch.zeros(b, max_new_tokens, dtype=torch.float32, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    cache = model.new_cache(b, width + max_new_tokens)
    all_full = bool((lens == width).all())  # no pad: the backends' plain path
    logits = model.forward_cached(padded, cache, 0, None if all_full else prompt_mask)[:, -1]
    steps = max_new_tokens
    for t in range(max_new_tokens):
        tok, lp = sample_next(logits, temperature, top_p, generator)
        live = ~done
        tok = torch.where(live, tok, pad)
        responses[:, t] = tok
        mask[:, t] = live
        logprobs[:, t] = torch.where(live, lp, 0.0)
        done = done | (tok == eos_id)
        if t + 1 == max_new_tokens or bool(done.all()):
            steps = t + 1
            break
        logits = model.forward_cached(tok[:, None], cache, width + t)[:, -1]
    return Generation.from_grids(ragged, responses[:, :steps], mask[:, :steps], logprobs[:, :steps], n=1)


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
