"""`Generation`: what a sampler or rollout engine returns -- sequences of their own length.

    >>> out = Generation.from_grids(prompts, responses, mask, logprobs, n=4)     # doctest: +SKIP
    >>> out.tokens          # Ragged int64: prompt, then response, per sample (no padding anywhere)
    >>> out.loss_mask       # Ragged bool, aligned with tokens: True on generated tokens (stop included)
    >>> out.logprobs        # Ragged float32, aligned: the sampler's log-prob of each generated token, else 0
    >>> out.prompt_lens     # [R] int64: how many leading tokens of each sample are its prompt
    >>> out.responses(pad=PAD)   # [R, T] the response tokens, right-padded (for rule-based rewards)

Sample ``i * n + k`` is completion ``k`` of prompt ``i`` (``repeat_interleave`` order). A per-token
tensor is *aligned* with ``tokens`` when entry ``j`` belongs to token ``j``: its log-prob, value or
loss weight, read from the model output at position ``j - 1`` (the state the token was chosen in).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flowrl.transport.ragged import Ragged


class Generation(NamedTuple):
    tokens: Ragged
    """int64, prompt + response per sample."""
    loss_mask: Ragged
    """bool, aligned with ``tokens``: True on generated tokens up to and including the first stop."""
    logprobs: Ragged
    """float32, aligned with ``tokens``: log-prob of each generated token (temperature-scaled, before
    top-p); 0 elsewhere."""
    prompt_lens: torch.Tensor
    """``[R]`` int64: prompt tokens at the start of each sample."""
    versions: Ragged | None = None
    """int64, aligned with ``tokens``: the weights version that produced each generated token, -1 on
    prompt tokens. Set by engines that let a version land mid-generation (continuous engines with
    partial rollouts); None: every token of the batch came from the engine's one version."""

    @property
    def num_samples(self) -> int:
        return self.tokens.num_samples

    @property
    def response_lens(self) -> torch.Tensor:
        return self.tokens.lengths - self.prompt_lens

    def responses(self, pad: int) -> torch.Tensor:
        """``[R, T]`` int64: each response, then ``pad`` (T = the longest response, at least 1)."""
        return response_grid(self.tokens, self.prompt_lens, pad)

    @classmethod
    def from_grids(cls, prompts: Ragged, responses: torch.Tensor, mask: torch.Tensor, logprobs: torch.Tensor,
                   n: int) -> "Generation":
        """Assemble from per-row response grids: ``responses``, ``mask`` (True on a prefix of each row:
        the generated tokens), ``logprobs`` all ``[R, T]`` with ``R = len(prompts) * n``."""
        prompts = prompts.to_torch()
        rows = prompts.num_samples * n
        if responses.shape[0] != rows or mask.shape != responses.shape or logprobs.shape != responses.shape:
            raise ValueError(f"expected [{rows}, T] responses, mask and log-probs ({prompts.num_samples} prompts x "
                             f"n={n}), got {tuple(responses.shape)}, {tuple(mask.shape)}, {tuple(logprobs.shape)}")
        mask = mask.bool().cpu()
        resp_lens = mask.sum(dim=1)
        if not torch.equal(mask, torch.arange(mask.shape[1])[None] < resp_lens[:, None]):
            raise ValueError("a response mask must be True on a prefix of its row (the generated tokens)")
        expanded = prompts.select(torch.arange(prompts.num_samples).repeat_interleave(n).numpy())
        p_lens = expanded.lengths.to(torch.int64)
        p_tok = expanded.values
        r_tok = responses.cpu().to(torch.int64)[mask]
        r_lp = logprobs.cpu().float()[mask]
        lens = p_lens + resp_lens
        offsets = torch.zeros(rows + 1, dtype=torch.int64)
        torch.cumsum(lens, 0, out=offsets[1:])
        total = int(offsets[-1])
        # every token's place: sample s's prompt at offsets[s] .., its response right after
        sample = torch.repeat_interleave(torch.arange(rows), lens)
        pos = torch.arange(total) - offsets[:-1].repeat_interleave(lens)
        is_resp = pos >= p_lens[sample]
        values = torch.empty(total, dtype=torch.int64)
        values[~is_resp] = p_tok
        values[is_resp] = r_tok
        lp = torch.zeros(total, dtype=torch.float32)
        lp[is_resp] = r_lp
        tokens = Ragged(values, offsets, check=False)
        return cls(tokens, tokens.like(is_resp), tokens.like(lp), p_lens)


def _parts(values: Ragged, prompt_lens: torch.Tensor) -> tuple[Ragged, Ragged]:
    """Each sequence's prompt part and response part, as two Raggeds."""
    values = values.to_torch()
    prompt_lens = prompt_lens.to(torch.int64).cpu()
    pos = torch.arange(values.total) - values.offsets[:-1].repeat_interleave(values.lengths)
    is_resp = pos >= prompt_lens[values.sample_ids()]
    p_off, r_off = torch.zeros_like(values.offsets), torch.zeros_like(values.offsets)
    torch.cumsum(prompt_lens, 0, out=p_off[1:])
    torch.cumsum(values.lengths - prompt_lens, 0, out=r_off[1:])
    return Ragged(values.values[~is_resp], p_off, check=False), Ragged(values.values[is_resp], r_off, check=False)


def response_grid(values: Ragged, prompt_lens: torch.Tensor, pad, width: int | None = None) -> torch.Tensor:
    """``[R, T]``: the response part of each sequence of ``values`` (tokens, or a tensor aligned with
    them), right-padded with ``pad`` (T: ``width``, else the longest response, at least 1)."""
    resp = _parts(values, prompt_lens)[1]
    longest = int(resp.lengths.max()) if resp.num_samples else 0
    return resp.to_padded(pad, width=max(longest, 1) if width is None else width)


def prompt_grid(values: Ragged, prompt_lens: torch.Tensor, pad) -> torch.Tensor:
    """``[R, P]``: the prompt part of each sequence, left-padded with ``pad`` (P: the longest prompt)."""
    return _parts(values, prompt_lens)[0].to_padded(pad, side="left")
