"""The Hugging Face engine: ``transformers``' own ``generate()`` (its cache, its sampling processors).

The model is the same ``{type: hf, path: ...}`` adapter the trainers use, so ``weights()`` has the
trainer's parameter names and a received version is live at once, as with the built-in engine.
Log-probs are recomputed from the unprocessed logits ``generate`` returns (``output_logits``), at
the sampling temperature and before top-p -- flowrl's convention. The draws come from torch's
global generator, seeded per call under ``torch.random.fork_rng`` so the caller's state is kept.

Prompts of different lengths go in as one batch, left-padded with ``pad_id`` under an attention
mask (``generate`` derives the position ids from it), so a padded position is never attended to
and every prompt is generated from as if it were alone; the result holds each prompt's own tokens.
Greedy decoding (``temperature <= 0``) runs each prompt once and repeats its completion ``n`` times.
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
    require_hf_model,
    response_logprobs,
)
from flowrl.engines.builtin import build_policy
from flowrl.models.generation import Generation
from flowrl.weights.adapters import AdaptedWeights


class HFEngine(RolloutEngine):
    type = "hf"

    def __init__(self, spec: Any, *, model: Any, device: str = "cpu", dtype: str = "float32", seed: int = 0,
                 **_: Any) -> None:
        self.spec = spec
        self.device = device
        self.model = build_policy(require_hf_model(model, "hf"), device=device, dtype=dtype, seed=seed)
        self.adapted = AdaptedWeights()  # base copies of the weights adapter versions changed

    def generate(self, prompts: Prompts, sampling: Sampling, *, seed: int) -> Generation:
        prompts = as_prompts(prompts)
        context, setting = context_of(self.model)
        check_prompts(prompts, sampling, context=context, setting=setting, vocab_size=self.model.vocab_size)
        n = sampling.n
        if not prompts.num_samples:
            return empty_generation(prompts, n)
        greedy = sampling.temperature <= 0
        draws = 1 if greedy else n  # greedy: every completion of a prompt is the same one
        kwargs: dict[str, Any] = dict(
            max_new_tokens=sampling.max_new_tokens, min_new_tokens=0, do_sample=not greedy,
            num_return_sequences=draws, eos_token_id=list(sampling.stops), pad_token_id=sampling.pad_id,
            return_dict_in_generate=True, output_logits=True, use_cache=True,
        )
        if not greedy:
            kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
        width = int(prompts.lengths.max())
        ids = prompts.to_padded(pad=sampling.pad_id, side="left")  # [B, W]: pads first, never attended
        attention = prompts.mask(side="left").long()
        devices = [torch.device(self.device)] if self.device.startswith("cuda") else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(seed)
            out = self.model.backbone.generate(input_ids=ids.to(self.device),
                                               attention_mask=attention.to(self.device), **kwargs)
        seqs = out.sequences[:, width:]  # [B * draws, T'] (T' <= max_new_tokens once every row has stopped)
        logits = torch.stack(out.logits, dim=1)  # [B * draws, T', V] unprocessed
        lps = response_logprobs(logits, seqs, sampling.temperature)
        stop = torch.isin(seqs, torch.tensor(sampling.stops, device=seqs.device))
        before = stop.int().cumsum(dim=1) - stop.int()  # stops strictly before each position
        mask = before == 0
        seqs, mask, lps = seqs.cpu(), mask.cpu(), (lps * mask).float().cpu()
        if draws != n:
            seqs, mask, lps = (x.repeat_interleave(n, 0) for x in (seqs, mask, lps))
        return Generation.from_grids(prompts, seqs, mask, lps, n)

    def weights(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        load_into(self.model.state_dict(), named_tensors, self.adapted)  # a full or an adapter version
        self.version = version
