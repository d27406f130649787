"""What every engine's result must look like, shared by the engine tests (no test in here).

``RAGGED`` is a batch of reverse-task prompts of 6, 9, 4 and 7 tokens: every engine gets prompts of
their own lengths, and each sample must start with exactly its prompt's tokens.
"""

from __future__ import annotations

import torch

from flowrl.tasks import EOS, PAD, build_task
from flowrl.transport.ragged import Ragged


def reverse_prompt(digits: int, index: int = 0) -> torch.Tensor:
    return build_task({"name": "reverse", "digits": digits}).prompts(0, index, 1)[0][0]


RAGGED = Ragged.from_sequences([reverse_prompt(3), reverse_prompt(6, 1), reverse_prompt(1, 2), reverse_prompt(4, 3)])
"""Four prompts of 6, 9, 4 and 7 tokens."""
RECT = build_task({"name": "reverse", "digits": 4}).prompts(0, 0, 3)[0]
"""``[3, 7]``: a legacy rectangular batch (three prompts of 7 tokens)."""


def assert_layout(out, prompts: Ragged, n: int, max_new: int, stops=(EOS,)) -> None:
    """``out`` is the ``len(prompts) * n`` samples of the engine contract (flowrl/engines/base.py)."""
    rows = prompts.num_samples * n
    assert out.tokens.num_samples == rows and out.tokens.values.dtype == torch.long
    assert out.tokens.aligned(out.loss_mask) and out.tokens.aligned(out.logprobs)
    assert out.loss_mask.values.dtype == torch.bool and out.logprobs.values.dtype == torch.float32
    assert out.prompt_lens.tolist() == prompts.lengths.repeat_interleave(n).tolist()
    for r in range(rows):
        prompt, seq = prompts[r // n], out.tokens[r]
        p = len(prompt)
        assert torch.equal(seq[:p], prompt), f"sample {r} does not start with exactly its prompt's tokens"
        mask, lp, resp = out.loss_mask[r], out.logprobs[r], seq[p:]
        assert not mask[:p].any() and mask[p:].all()  # True exactly on the response
        assert 1 <= len(resp) <= max_new
        assert (lp[:p] == 0).all() and (lp[p:] <= 0).all() and torch.isfinite(lp).all()
        ends = [int(x) in stops for x in resp]
        assert not any(ends[:-1]) and (ends[-1] or len(resp) == max_new), f"sample {r}: {resp.tolist()}"


def recompute(model, out, temperature: float) -> torch.Tensor:
    """The log-probs the trainer computes for ``out`` (one unpadded forward per sample), aligned with
    ``out.tokens.values``, 0 off the response."""
    parts = []
    with torch.no_grad():
        for seq in out.tokens:
            logits = model(seq[None])[0, :-1].float()
            if temperature > 0:
                logits = logits / temperature
            lp = torch.log_softmax(logits, dim=-1).gather(-1, seq[1:, None]).squeeze(-1)
            parts.append(torch.cat([torch.zeros(1), lp]))
    return torch.cat(parts) * out.loss_mask.values


def assert_batch_equals_alone(engine, prompts: Ragged, sampling, atol: float) -> None:
    """Greedy: each prompt generated inside the ragged batch is what it is generated alone."""
    together = engine.generate(prompts, sampling, seed=0)
    n = sampling.n
    for i in range(prompts.num_samples):
        alone = engine.generate(prompts.select(slice(i, i + 1)), sampling, seed=0)
        for k in range(n):
            r = i * n + k
            assert torch.equal(together.tokens[r], alone.tokens[k]), \
                f"prompt {i}: {together.tokens[r].tolist()} in the batch, {alone.tokens[k].tolist()} alone"
            gap = float((together.logprobs[r] - alone.logprobs[k]).abs().max())
            assert gap <= atol, f"prompt {i}: log-probs in the batch and alone differ by {gap}"


def too_long(max_new: int, context: int) -> Ragged:
    """A short prompt, then one a token too long for ``context`` with ``max_new`` tokens to come."""
    return Ragged.from_sequences([reverse_prompt(2), [1] * (context - max_new + 1)])


__all__ = ["EOS", "PAD", "RAGGED", "RECT", "assert_batch_equals_alone", "assert_layout", "recompute", "too_long"]
