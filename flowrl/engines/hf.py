"""The Hugging Face engine: ``transformers``' own ``generate()`` (its cache, its sampling processors).

The model is the same ``{type: hf, path: ...}`` adapter the trainers use, so ``weights()`` has the
trainer's parameter names and a received version is live at once, as with the built-in engine.
Log-probs are recomputed from the unprocessed logits ``generate`` returns (``output_logits``), at
the sampling temperature and before top-p -- flowrl's convention. The draws come from torch's
global generator, seeded per call under ``torch.random.fork_rng`` so the caller's state is kept.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from flowrl.engines.base import RolloutEngine, Sampling, copy_into, require_hf_model, response_logprobs
from flowrl.engines.builtin import build_policy
from flowrl.models.sampling import Generation


class HFEngine(RolloutEngine):
    type = "hf"

    def __init__(self, spec: Any, *, model: Any, device: str = "cpu", dtype: str = "float32", seed: int = 0,
                 **_: Any) -> None:
        self.spec = spec
        self.device = device
        self.model = build_policy(require_hf_model(model, "hf"), device=device, dtype=dtype, seed=seed)

    def generate(self, prompts: torch.Tensor, sampling: Sampling, *, seed: int) -> Generation:
        b, p = prompts.shape
        t = sampling.max_new_tokens
        greedy = sampling.temperature <= 0
        kwargs: dict[str, Any] = dict(
            max_new_tokens=t, min_new_tokens=0, do_sample=not greedy, num_return_sequences=sampling.n,
            eos_token_id=list(sampling.stops), pad_token_id=sampling.pad_id,
            return_dict_in_generate=True, output_logits=True, use_cache=True,
        )
        if not greedy:
            kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
        devices = [torch.device(self.device)] if self.device.startswith("cuda") else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(seed)
            out = self.model.backbone.generate(input_ids=prompts.to(self.device),
                                               attention_mask=torch.ones_like(prompts, device=self.device), **kwargs)
        seqs = out.sequences[:, p:]  # [B*n, T'] (T' <= t once every row has stopped)
        logits = torch.stack(out.logits, dim=1)  # [B*n, T', V] unprocessed
        lps = response_logprobs(logits, seqs, sampling.temperature)
        stop = torch.isin(seqs, torch.tensor(sampling.stops, device=seqs.device))
        before = stop.int().cumsum(dim=1) - stop.int()  # stops strictly before each position
        mask = before == 0
        rows = b * sampling.n
        tokens = torch.full((rows, p + t), sampling.pad_id, dtype=torch.long)
        tokens[:, :p] = prompts.cpu().repeat_interleave(sampling.n, 0)
        full_mask = torch.zeros(rows, t, dtype=torch.bool)
        full_lp = torch.zeros(rows, t, dtype=torch.float32)
        k = seqs.shape[1]
        tokens[:, p : p + k] = torch.where(mask, seqs, sampling.pad_id).cpu()
        full_mask[:, :k] = mask.cpu()
        full_lp[:, :k] = (lps * mask).float().cpu()
        return Generation(tokens, full_mask, full_lp)

    def weights(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        copy_into(self.model.state_dict(), named_tensors)
        self.version = version
