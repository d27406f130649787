"""The interface every rollout engine implements, and the batch layout they all produce.

    >>> engine = build_engine({"type": "vllm"}, model={"type": "hf", "path": "models/hf-tiny"},
    ...                       device="cpu", dtype="float32", seed=0)              # doctest: +SKIP
    >>> out = engine.generate(prompts, Sampling(n=8, temperature=1.0, max_new_tokens=7,
    ...                                         eos_id=EOS, pad_id=PAD), seed=123) # doctest: +SKIP
    >>> out.tokens.shape, out.response_mask.shape, out.logprobs.shape             # doctest: +SKIP
    (torch.Size([B * 8, P + 7]), torch.Size([B * 8, 7]), torch.Size([B * 8, 7]))
    >>> engine.load_weights(named_tensors, version=3)                              # doctest: +SKIP

Whatever the backend, ``generate`` returns a :class:`flowrl.models.Generation` laid out exactly as
the built-in sampler lays it out (see ``nodes/common.py``): the ``n`` completions of prompt ``i``
are rows ``i * n .. i * n + n - 1`` (``prompts.repeat_interleave(n, 0)`` order); each row is the
prompt, then the response padded with ``pad_id`` to ``max_new_tokens``; the mask is True up to
and including the first stop token (EOS or one of ``stop_token_ids``); log-probs are those of the
temperature-scaled distribution before top-p truncation, 0 where the mask is False.

Weights: ``weights()`` returns named tensors the runtime overwrites with each new version (the
names, shapes and dtypes of the trainer's ``weights()``), then the runtime calls
``load_weights(named_tensors, version)``. An engine that generates from those very tensors (the
built-in ones) has nothing left to do; an engine with weights of its own (vLLM) copies them in.
``load_weights`` accepts any iterable of ``(name, tensor)`` pairs, so it can also be called with
tensors that never went through ``weights()`` (a loader callback).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from flowrl.models.sampling import Generation


@dataclass(frozen=True)
class Sampling:
    """What to sample: set once on the rollout, the same for every engine."""

    n: int
    """Completions per prompt."""
    temperature: float
    """Softmax temperature; 0 = greedy."""
    max_new_tokens: int
    """Response budget; responses are padded to it."""
    eos_id: int
    """Ends a response (included in it)."""
    pad_id: int
    """Fills a response after its end."""
    top_p: float = 1.0
    """Nucleus mass (log-probs stay those of the untruncated distribution where the engine allows)."""
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    """More tokens that end a response, like EOS."""

    @property
    def stops(self) -> tuple[int, ...]:
        return (self.eos_id, *self.stop_token_ids)


class RolloutEngine(ABC):
    """Base class of the rollout backends; see the module docstring for the contract."""

    type: str

    @abstractmethod
    def generate(self, prompts: torch.Tensor, sampling: Sampling, *, seed: int) -> Generation:
        """``prompts [B, P]`` int64 (equal lengths) -> ``B * n`` completions; ``seed`` fixes the draws."""

    @abstractmethod
    def weights(self) -> dict[str, torch.Tensor]:
        """Named tensors the runtime receives each new version into (the trainer's names)."""

    @abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Make the engine generate with these weights from now on; ``version`` labels them."""

    version: int = 0
    """Version of the weights the engine generates with."""

    def close(self) -> None:
        """Release the engine's memory and threads."""


def copy_into(live: dict[str, torch.Tensor], named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy ``named_tensors`` into ``live`` (skipping a tensor that already is the live one).

    Every name must be known and every shape equal; returns the number of tensors copied. Names
    of ``live`` not given keep their values (a partial update)."""
    copied = 0
    with torch.no_grad():
        for name, tensor in named_tensors:
            dst = live.get(name)
            if dst is None:
                close = [k for k in live if k.endswith(name.rsplit(".", 1)[-1])][:3]
                raise KeyError(f"weight {name!r} is not a parameter of the rollout model (similar: {close})")
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} does not match the rollout's "
                                 f"{tuple(dst.shape)}; trainer and rollout must build the same model")
            if dst.data_ptr() != tensor.data_ptr():
                dst.copy_(tensor)
                copied += 1
    return copied


def pack_completions(prompts: torch.Tensor, completions: Sequence[tuple[Sequence[int], Sequence[float]]],
                     sampling: Sampling) -> Generation:
    """Lay out ``B * n`` completions (token ids, their log-probs) as the built-in sampler does.

    ``completions`` are in ``repeat_interleave`` order; a completion may stop before
    ``max_new_tokens`` (after a stop token, or when the engine ran out of length). Anything after
    the first stop token is cut.
    """
    b, p = prompts.shape
    rows = b * sampling.n
    if len(completions) != rows:
        raise ValueError(f"expected {rows} completions ({b} prompts x n={sampling.n}), got {len(completions)}")
    t = sampling.max_new_tokens
    tokens = torch.full((rows, p + t), sampling.pad_id, dtype=torch.long)
    tokens[:, :p] = prompts.cpu().repeat_interleave(sampling.n, 0)
    mask = torch.zeros(rows, t, dtype=torch.bool)
    logprobs = torch.zeros(rows, t, dtype=torch.float32)
    stops = set(sampling.stops)
    for r, (ids, lps) in enumerate(completions):
        ids = list(ids)[:t]
        for k, tok in enumerate(ids):
            if tok in stops:
                ids = ids[: k + 1]
                break
        k = len(ids)
        if k:
            tokens[r, p : p + k] = torch.tensor(ids, dtype=torch.long)
            mask[r, :k] = True
            logprobs[r, :k] = torch.tensor(list(lps)[:k], dtype=torch.float32)
    return Generation(tokens, mask, logprobs)


def response_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probs ``[B, T]`` of ``tokens [B, T]`` under ``logits [B, T, V]`` at ``temperature`` (0: unscaled)."""
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def require_hf_model(model: Any, engine: str) -> Any:
    """The engines that run a Hugging Face checkpoint need ``model: {type: hf, path: ...}``."""
    from flowrl.models import parse_model_spec

    spec = parse_model_spec(model)
    if spec.type != "hf":
        raise ValueError(
            f"rollout engine `{engine}` runs a Hugging Face checkpoint, but the rollout's model is "
            f"{{type: {spec.type}}}; set the model to {{type: hf, path: FOLDER}} (python "
            "examples/hf_tiny/make_model.py writes a small one) or use engine {type: builtin}"
        )
    return spec
