"""The interface every rollout engine implements, and the batch layout they all produce.

    >>> prompts = Ragged.from_sequences([[1, 5, 6, 9], [1, 7, 9]])              # each its own length
    >>> engine = build_engine({"type": "vllm"}, model={"type": "hf", "path": "models/hf-tiny"},
    ...                       device="cpu", dtype="float32", seed=0)              # doctest: +SKIP
    >>> out = engine.generate(prompts, Sampling(n=8, temperature=1.0, max_new_tokens=7,
    ...                                         eos_id=EOS, pad_id=PAD), seed=123) # doctest: +SKIP
    >>> out.tokens.num_samples, out.prompt_lens[:9].tolist()                       # doctest: +SKIP
    (16, [4, 4, 4, 4, 4, 4, 4, 4, 3])
    >>> engine.load_weights(named_tensors, version=3)                              # doctest: +SKIP

Prompts are a :class:`~flowrl.transport.ragged.Ragged` of token ids, every prompt its own length
(a rectangular ``[B, P]`` tensor is still accepted: ``B`` prompts of ``P`` tokens each). Whatever
the backend, ``generate`` returns a :class:`flowrl.models.generation.Generation` of ``B * n``
samples, each exactly as long as it is -- nothing in it is padding:

- the ``n`` completions of prompt ``i`` are samples ``i * n .. i * n + n - 1`` (``repeat_interleave``
  order);
- sample ``r`` is its prompt's own tokens (``prompt_lens[r]`` of them), then its response: the
  generated tokens up to and including the first stop token (EOS or one of ``stop_token_ids``),
  or ``max_new_tokens`` of them when none came;
- ``loss_mask`` (aligned with ``tokens``) is True exactly on the response tokens;
- ``logprobs`` (aligned) are those of the temperature-scaled distribution before top-p truncation
  (vLLM: after it, see its module), 0 off the response.

``pad_id`` is what an engine may pad with internally (left of a shorter prompt in a batch, after a
finished response); a padded position is never attended to, so changing ``pad_id`` changes no
token and no log-prob. A prompt must hold at least one token, and it must leave room for the
response: its length plus ``max_new_tokens`` may not exceed the model's context (``max_seq_len``
of the built-in model, ``max_position_embeddings`` of a Hugging Face one, vLLM's
``max_model_len``). :func:`check_prompts` says which prompt breaks that, before anything runs.

Weights: ``weights()`` returns named tensors the runtime overwrites with each new version (the
names, shapes and dtypes of the trainer's ``weights()``), then the runtime calls
``load_weights(named_tensors, version)``. An engine that generates from those very tensors (the
built-in ones) has nothing left to do; an engine with weights of its own (vLLM) copies them in.
``load_weights`` accepts any iterable of ``(name, tensor)`` pairs, so it can also be called with
tensors that never went through ``weights()`` (a loader callback).

Adapter versions (LoRA, ``flowrl.weights.adapters``): ``load_weights`` may instead get only
``P.lora_A`` / ``P.lora_B`` pairs; every engine then serves ``base + B @ A`` for each adapted
weight, whole or not at all, with the base kept for the adapted tensors only (versions never
accumulate). The rollout says so to the runtime (``applies_adapters``), which hands them on as
they came.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from flowrl.models.generation import Generation
from flowrl.transport.ragged import Ragged
from flowrl.weights.adapters import AdaptedWeights, is_adapter_version

Prompts = Ragged | torch.Tensor
"""What ``generate`` takes: a Ragged of token ids (each prompt its own length), or ``[B, P]`` full rows."""


@dataclass(frozen=True)
class Sampling:
    """What to sample: set once on the rollout, the same for every engine."""

    n: int
    """Completions per prompt."""
    temperature: float
    """Softmax temperature; 0 = greedy."""
    max_new_tokens: int
    """Response budget: the most tokens a response gets."""
    eos_id: int
    """Ends a response (included in it)."""
    pad_id: int
    """What an engine pads with internally; never attended to, never in a :class:`Generation`."""
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
    def generate(self, prompts: Prompts, sampling: Sampling, *, seed: int) -> Generation:
        """``B`` prompts (each its own length) -> ``B * n`` samples; ``seed`` fixes the draws."""

    @abstractmethod
    def weights(self) -> dict[str, torch.Tensor]:
        """Named tensors the runtime receives each new version into (the trainer's names)."""

    def weight_target(self) -> Any:
        """What the runtime receives each new version into (a `WeightSubscriber`'s target): by
        default `weights()`, whose tensors take each complete version by a copy. An engine whose
        model nothing else points into (no captured graph, no fused weight cache) returns the
        module instead: a complete version is then taken by repointing its tensors at the buffer it
        arrived in, with no copy (flowrl.weights.subscriber, "swap")."""
        return self.weights()

    @abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Make the engine generate with these weights from now on; ``version`` labels them."""

    version: int = 0
    """Version of the weights the engine generates with."""

    continuous: bool = False
    """True when ``submit`` batches continuously: several calls (tickets) may await it at once and
    their sequences share iteration-level batches (Orca-style), and a new weights version may land
    between two iterations (``before_weights`` / ``load_weights``, see ``on_new_weights``)."""

    on_new_weights: str = "finish"
    """What a version arriving mid-generation does to the sequences in flight (continuous engines):
    ``keep``: they pause, the weights load, they go on (their KV cache and earlier tokens stay; every
    token records the version that produced it: partial rollouts); ``restart``: they start again from
    their prompts with the new weights; ``finish``: the version waits until the running sequences
    finish on the old weights (new ones wait for the new weights)."""

    async def submit(self, prompts: Prompts, sampling: Sampling, *, seed: int) -> Generation:
        """``generate`` for a caller on the node's compute loop. A continuous engine overrides it:
        the prompts join the running batch as slots free up, and the call returns when all of its
        samples are done (``versions`` set per token). Default: one batch-at-a-time ``generate``."""
        return self.generate(prompts, sampling, seed=seed)

    async def before_weights(self, version: int) -> None:
        """Called on the compute loop before a new version's tensors change (``load_weights`` follows
        once it returns). A continuous engine stops between two iterations here (``finish``: once its
        running sequences are done); the default has nothing in flight."""

    def resume(self) -> None:
        """A version announced with ``before_weights`` will not land (its sync failed): go on with
        the weights held. The default has nothing paused."""

    def stats(self) -> dict[str, float]:
        """Counters for metrics: ``running`` and ``waiting`` sequences now; ``busy_s`` (seconds spent
        generating), ``tokens`` (generated), ``weight_pause_s`` (seconds stopped for weights) and
        ``weight_loads`` since the engine started. Engines without them return {}."""
        return {}

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


def load_into(live: dict[str, torch.Tensor], named_tensors: Iterable[tuple[str, torch.Tensor]],
              adapted: AdaptedWeights) -> int:
    """A full version (or part of one) copied into ``live`` (see :func:`copy_into`), or an adapter
    version applied to it in place (``base + B @ A``, whole or not at all; ``adapted`` keeps the
    bases). Returns the number of tensors written."""
    named = list(named_tensors)
    if is_adapter_version(n for n, _ in named):
        return adapted.apply(live, dict(named))
    copied = copy_into(live, named)
    adapted.forget(n for n, _ in named)  # what they hold now is their base
    return copied


def as_prompts(prompts: Any) -> Ragged:
    """``prompts`` as a CPU torch Ragged of int64 token ids.

    A Ragged passes through (converted); a ``[B, P]`` tensor or array is ``B`` prompts of ``P``
    tokens each (no padding in it); a list of sequences is one prompt per sequence."""
    if isinstance(prompts, Ragged):
        r = prompts.to_torch()
    elif torch.is_tensor(prompts) or isinstance(prompts, np.ndarray):
        p = torch.as_tensor(prompts)
        if p.dim() != 2:
            raise ValueError(f"prompts must be a Ragged of token ids or a [B, P] tensor, got shape {tuple(p.shape)}")
        r = Ragged.from_padded(p)
    elif isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes)):
        r = Ragged.from_sequences(prompts, "int64")
    else:
        raise TypeError(f"prompts must be a Ragged of token ids or a [B, P] tensor, got {type(prompts).__name__}")
    if r.ndim != 2:
        raise ValueError(f"prompts must hold one token id per position, got values of shape {tuple(r.values.shape)}")
    if r.values.dtype.is_floating_point or r.values.dtype.is_complex or r.values.dtype == torch.bool:
        raise TypeError(f"prompt tokens must be integer ids, got {r.values.dtype}")
    return Ragged(r.values.detach().to("cpu", torch.int64), r.offsets.detach().cpu(), check=False)


def check_prompts(prompts: Ragged, sampling: Sampling, *, context: int | None, setting: str,
                  vocab_size: int | None = None) -> None:
    """Raise a ValueError naming the first bad prompt, before anything is generated.

    Every prompt needs a token, its ids must be below ``vocab_size``, and it must leave
    ``max_new_tokens`` room within ``context`` tokens (``setting`` says where that limit is set)."""
    if sampling.n < 1:
        raise ValueError(f"Sampling.n must be >= 1 (completions per prompt), got {sampling.n}")
    if sampling.max_new_tokens < 1:
        raise ValueError(f"Sampling.max_new_tokens must be >= 1, got {sampling.max_new_tokens}")
    lens = prompts.lengths
    empty = torch.nonzero(lens == 0).flatten()
    if len(empty):
        raise ValueError(
            f"prompt {int(empty[0])} is empty ({len(empty)} of {len(lens)} prompts have no tokens): a prompt needs "
            "at least one token to generate after (a BOS token, a chat template's prefix); drop or fill it"
        )
    values = prompts.values
    if len(values) and (int(values.min()) < 0 or (vocab_size is not None and int(values.max()) >= vocab_size)):
        bad = (values < 0) | (values >= vocab_size) if vocab_size is not None else values < 0
        at = int(torch.nonzero(bad).flatten()[0])
        sample = int(torch.searchsorted(prompts.offsets, torch.tensor(at), right=True)) - 1
        raise ValueError(f"prompt {sample} holds token id {int(values[at])}, outside the model's vocabulary "
                         f"0..{vocab_size - 1 if vocab_size is not None else 'V - 1'}; check the tokenizer")
    if context is None:
        return
    room = context - sampling.max_new_tokens
    if room < 1:
        raise ValueError(f"max_new_tokens={sampling.max_new_tokens} leaves no room for a prompt in the model's "
                         f"context of {context} tokens ({setting}); lower max_new_tokens or raise {setting}")
    long = torch.nonzero(lens > room).flatten()
    if len(long):
        i = int(long[0])
        more = f" ({len(long)} of {len(lens)} prompts are too long)" if len(long) > 1 else ""
        raise ValueError(
            f"prompt {i} has {int(lens[i])} tokens, more than the {room} that fit: the model's context of {context} "
            f"tokens ({setting}) minus max_new_tokens={sampling.max_new_tokens}{more}; shorten or drop the prompt "
            f"(e.g. a lower prompt length limit in the data source), lower max_new_tokens, or raise {setting}"
        )


def context_of(model: Any) -> tuple[int | None, str]:
    """The most tokens (prompt + response) a flowrl model takes, and where that is set."""
    spec = getattr(model, "spec", None)
    if getattr(spec, "max_seq_len", None) is not None:
        return int(spec.max_seq_len), "the model's max_seq_len"
    config = getattr(getattr(model, "backbone", None), "config", None)
    limit = getattr(config, "max_position_embeddings", None)
    return (int(limit) if limit else None), "max_position_embeddings in the model's config.json"


def repeat_prompts(prompts: Ragged, n: int) -> Ragged:
    """Each prompt ``n`` times in a row (``repeat_interleave`` order)."""
    return prompts if n == 1 else prompts.select(np.repeat(np.arange(prompts.num_samples, dtype=np.int64), n))


def empty_generation(prompts: Ragged, n: int) -> Generation:
    """What ``generate`` returns for no prompts at all."""
    none = torch.zeros(0, 0)
    return Generation.from_grids(prompts, none.long(), none.bool(), none, n)


def to_cpu(out: Generation) -> Generation:
    """``out`` with every tensor on the CPU (log-probs float32)."""
    def cpu(r: Ragged, values: torch.Tensor) -> Ragged:
        return Ragged(values, r.offsets.cpu(), check=False)

    tokens = cpu(out.tokens, out.tokens.values.cpu())
    return Generation(tokens, cpu(out.loss_mask, out.loss_mask.values.cpu()),
                      cpu(out.logprobs, out.logprobs.values.float().cpu()), out.prompt_lens.cpu())


def pack_completions(prompts: Prompts, completions: Sequence[tuple[Sequence[int], Sequence[float]]],
                     sampling: Sampling) -> Generation:
    """Lay ``B * n`` completions (token ids, their log-probs) out as a :class:`Generation`.

    ``completions`` are in ``repeat_interleave`` order; a completion may stop before
    ``max_new_tokens`` (after a stop token, or when the engine ran out of length). Anything after
    the first stop token, or beyond ``max_new_tokens``, is cut.
    """
    prompts = as_prompts(prompts)
    b, n = prompts.num_samples, sampling.n
    rows = b * n
    if len(completions) != rows:
        raise ValueError(f"expected {rows} completions ({b} prompts x n={n}), got {len(completions)}")
    stops = set(sampling.stops)
    cut = []
    for ids, lps in completions:
        ids, lps = list(ids)[: sampling.max_new_tokens], list(lps)
        for k, tok in enumerate(ids):
            if tok in stops:
                ids = ids[: k + 1]
                break
        if len(lps) < len(ids):
            raise ValueError(f"a completion of {len(ids)} tokens came with only {len(lps)} log-probs")
        cut.append((ids, lps[: len(ids)]))
    width = max((len(ids) for ids, _ in cut), default=0)
    tokens = torch.full((rows, width), sampling.pad_id, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    logprobs = torch.zeros(rows, width, dtype=torch.float32)
    for r, (ids, lps) in enumerate(cut):
        if ids:
            tokens[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[r, : len(ids)] = True
            logprobs[r, : len(ids)] = torch.tensor(lps, dtype=torch.float32)
    return Generation.from_grids(prompts, tokens, mask, logprobs, n)


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
