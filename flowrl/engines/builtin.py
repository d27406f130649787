"""The built-in engine: flowrl's own KV-cache sampler over any flowrl model (tiny or Hugging Face).

It generates straight from the model whose tensors ``weights()`` returns, so a received version
is live the moment the runtime has written it, and a batch's tokens are a pure function of
(seed, weights): the same seed gives the same completions, and its log-probs are exactly what the
trainer recomputes. The prompts go to ``flowrl.models.generate`` as a Ragged, each its own length,
each repeated ``n`` times; what that returns is already the engine's layout.

With ``continuous: true`` (built-in tiny model only), ``submit`` goes through a
:class:`~flowrl.engines.continuous.ContinuousBatcher` instead: every ticket in flight shares one
iteration-level batch, and a version may land mid-generation (``on_new_weights``). ``generate``
stays batch-at-a-time and bitwise as above.
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
    load_into,
    empty_generation,
    repeat_prompts,
    to_cpu,
)
from flowrl.models.generation import Generation
from flowrl.weights.adapters import AdaptedWeights


def build_policy(model: Any, *, device: str, dtype: str, seed: int) -> torch.nn.Module:
    """A frozen policy on ``device`` in ``dtype``: seeded init, so every copy starts bitwise equal."""
    from flowrl.models import build_model

    policy = build_model(model, seed=seed).to(device=device)
    if dtype != "float32":
        policy = policy.to(dtype=getattr(torch, dtype))
    return policy.eval().requires_grad_(False)


def refuse_continuous_hf(model: Any) -> None:
    """Continuous batching needs the slot cache of the built-in model (``TinyLM.forward_slots``)."""
    from flowrl.models import parse_model_spec

    kind = parse_model_spec(model).type
    if kind != "tiny":
        raise ValueError(
            f"engine {{type: builtin, continuous: true}} needs the built-in model {{type: tiny}}, but the rollout's "
            f"model is {{type: {kind}}}; set `continuous: false` (batch at a time) or use engine {{type: vllm}} "
            "for continuous batching of a Hugging Face model"
        )


class BuiltinEngine(RolloutEngine):
    type = "builtin"

    def __init__(self, spec: Any, *, model: Any, device: str = "cpu", dtype: str = "float32", seed: int = 0,
                 on_new_weights: str = "finish", **_: Any) -> None:
        self.spec = spec
        self.device = device
        self.on_new_weights = on_new_weights
        self.continuous = bool(getattr(spec, "continuous", False))
        if self.continuous:
            refuse_continuous_hf(model)
        self.model = build_policy(model, device=device, dtype=dtype, seed=seed)
        self.adapted = AdaptedWeights()  # base copies of the weights adapter versions changed
        self.batcher = None
        if self.continuous:
            from flowrl.engines.continuous import ContinuousBatcher

            self.batcher = ContinuousBatcher(self.model, max_num_seqs=spec.max_num_seqs, max_len=self._max_len(),
                                             seed=seed, device=device)

    def _max_len(self) -> int:
        limit = getattr(self.spec, "max_len", None)
        return self.model.spec.max_seq_len if limit is None else min(limit, self.model.spec.max_seq_len)

    def _checked(self, prompts: Prompts, sampling: Sampling) -> Any:
        if sampling.stop_token_ids:
            raise ValueError(
                f"stop_token_ids={list(sampling.stop_token_ids)}: the builtin engine stops at EOS only; "
                "use engine {type: hf} or {type: vllm} for more stop tokens"
            )
        prompts = as_prompts(prompts)
        context, setting = context_of(self.model)
        if self.batcher is not None and self._max_len() < context:
            context, setting = self._max_len(), "the engine's max_len"
        check_prompts(prompts, sampling, context=context, setting=setting, vocab_size=self.model.vocab_size)
        return prompts

    def generate(self, prompts: Prompts, sampling: Sampling, *, seed: int) -> Generation:
        from flowrl.models import generate

        prompts = self._checked(prompts, sampling)
        if not prompts.num_samples:
            return empty_generation(prompts, sampling.n)
        rng = torch.Generator(device=self.device).manual_seed(seed)
        out = generate(self.model, repeat_prompts(prompts, sampling.n),
                       max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                       top_p=sampling.top_p, eos_id=sampling.eos_id, pad_id=sampling.pad_id, generator=rng)
        return to_cpu(out)

    async def submit(self, prompts: Prompts, sampling: Sampling, *, seed: int) -> Generation:
        """Continuous: join the running batch (``seed`` unused: one engine-level generator); else
        ``generate``."""
        if self.batcher is None:
            return self.generate(prompts, sampling, seed=seed)
        prompts = self._checked(prompts, sampling)
        if not prompts.num_samples:
            out = empty_generation(prompts, sampling.n)
            return out._replace(versions=out.tokens.like(out.tokens.values.clone()))
        return await self.batcher.submit(prompts, sampling)

    async def before_weights(self, version: int) -> None:
        if self.batcher is not None:
            await self.batcher.before_weights(self.on_new_weights)

    def stats(self) -> dict[str, float]:
        return {} if self.batcher is None else self.batcher.stats()

    def weights(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()  # live tensors: a new version is received in place

    def weight_target(self) -> torch.nn.Module:
        return self.model  # nothing else holds its storage: a version is swapped in, not copied

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        load_into(self.model.state_dict(), named_tensors, self.adapted)  # a full or an adapter version
        self.version = version
        if self.batcher is not None:
            self.batcher.weights_loaded(version)

    def resume(self) -> None:
        if self.batcher is not None:  # the weights did not change: tokens go on carrying the version held
            self.batcher.weights_loaded(self.version)

    def close(self) -> None:
        if self.batcher is not None:
            self.batcher.close()
