"""The built-in engine: flowrl's own KV-cache sampler over any flowrl model (tiny or Hugging Face).

It generates straight from the model whose tensors ``weights()`` returns, so a received version
is live the moment the runtime has written it, and a batch's tokens are a pure function of
(seed, weights): the same seed gives the same completions, and its log-probs are exactly what the
trainer recomputes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from flowrl.engines.base import RolloutEngine, Sampling, copy_into
from flowrl.models.sampling import Generation


def build_policy(model: Any, *, device: str, dtype: str, seed: int) -> torch.nn.Module:
    """A frozen policy on ``device`` in ``dtype``: seeded init, so every copy starts bitwise equal."""
    from flowrl.models import build_model

    policy = build_model(model, seed=seed).to(device=device)
    if dtype != "float32":
        policy = policy.to(dtype=getattr(torch, dtype))
    return policy.eval().requires_grad_(False)


class BuiltinEngine(RolloutEngine):
    type = "builtin"

    def __init__(self, spec: Any, *, model: Any, device: str = "cpu", dtype: str = "float32", seed: int = 0,
                 **_: Any) -> None:
        self.spec = spec
        self.device = device
        self.model = build_policy(model, device=device, dtype=dtype, seed=seed)

    def generate(self, prompts: torch.Tensor, sampling: Sampling, *, seed: int) -> Generation:
        from flowrl.models import generate

        if sampling.stop_token_ids:
            raise ValueError(
                f"stop_token_ids={list(sampling.stop_token_ids)}: the builtin engine stops at EOS only; "
                "use engine {type: hf} or {type: vllm} for more stop tokens"
            )
        rng = torch.Generator(device=self.device).manual_seed(seed)
        out = generate(self.model, prompts.repeat_interleave(sampling.n, 0).to(self.device),
                       max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                       top_p=sampling.top_p, eos_id=sampling.eos_id, pad_id=sampling.pad_id, generator=rng)
        return Generation(out.tokens.cpu(), out.response_mask.cpu(), out.logprobs.float().cpu())

    def weights(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()  # live tensors: a new version is received in place

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        copy_into(self.model.state_dict(), named_tensors)
        self.version = version
