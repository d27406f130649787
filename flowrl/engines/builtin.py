"""The built-in engine: flowrl's own KV-cache sampler over any flowrl model (tiny or Hugging Face).

It generates straight from the model whose tensors ``weights()`` returns, so a received version
is live the moment the runtime has written it, and a batch's tokens are a pure function of
(seed, weights): the same seed gives the same completions, and its log-probs are exactly what the
trainer recomputes. The prompts go to ``flowrl.models.generate`` as a Ragged, each its own length,
each repeated ``n`` times; what that returns is already the engine's layout.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from flowrl.engines.base import (
    Prompts,
    RolloutEngine,
    Sampling,
    as_prompts,
    check_prompts,
    context_of,
    copy_into,
    empty_generation,
    repeat_prompts,
    to_cpu,
)
from flowrl.models.generation import Generation


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

    def generate(self, prompts: Prompts, sampling: Sampling, *, seed: int) -> Generation:
        from flowrl.models import generate

        if sampling.stop_token_ids:
            raise ValueError(
                f"stop_token_ids={list(sampling.stop_token_ids)}: the builtin engine stops at EOS only; "
                "use engine {type: hf} or {type: vllm} for more stop tokens"
            )
        prompts = as_prompts(prompts)
        context, setting = context_of(self.model)
        check_prompts(prompts, sampling, context=context, setting=setting, vocab_size=self.model.vocab_size)
        if not prompts.num_samples:
            return empty_generation(prompts, sampling.n)
        rng = torch.Generator(device=self.device).manual_seed(seed)
        out = generate(self.model, repeat_prompts(prompts, sampling.n),
                       max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                       top_p=sampling.top_p, eos_id=sampling.eos_id, pad_id=sampling.pad_id, generator=rng)
        return to_cpu(out)

    def weights(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()  # live tensors: a new version is received in place

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        copy_into(self.model.state_dict(), named_tensors)
        self.version = version
