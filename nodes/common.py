"""Pieces the built-in role nodes share: config fields and the tensors they pass along.

A batch that flows through the PPO / GRPO graphs carries, as it grows (R = B x samples_per_prompt;
"ragged" = one sequence of its own length per sample, `flowrl.Ragged`; "aligned" = ragged with the
offsets of `tokens`, entry j belonging to token j):

    prompts   prompts ragged int64 (each prompt its own tokens), targets [B, A] int64   (meta: max_new_tokens)
    rollout   + tokens ragged int64 (prompt, then response: no padding anywhere), prompt_lens [R] int64,
                loss_mask aligned bool (True on generated tokens, stop included), logprobs aligned float32
                (the sampler's log-prob of each generated token), versions aligned int64 (the policy
                version that generated each token; -1 on prompt tokens)
                (meta: samples_per_prompt, temperature, top_p, rollout_engine)
    reward    + scores [R] float32
    reference + ref_logprobs aligned float32
    critic    + values, advantages, returns: aligned float32
    advantages (GRPO) + advantages aligned float32

Every built-in node also takes the rectangular layout of earlier versions (tokens [R, P+T],
response_mask [R, T], per-token tensors [R, T]; what `rollout: {layout: padded}` emits) and answers in
the layout it was given, so user nodes written for it keep working. `Sequences.of(batch)` reads
either.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from pydantic import Field

import flowrl
from flowrl.models import ModelSpec, TinyLMSpec
from flowrl.tasks import ReverseSpec, TaskSpec


class Sequences(NamedTuple):
    """A batch's sequences, whatever its layout: ragged tokens, the aligned loss mask, prompt lengths."""

    tokens: Any
    """Ragged int64 (torch)."""
    loss_mask: Any
    """Ragged bool, aligned with tokens."""
    prompt_lens: Any
    """[R] int64."""
    padded_width: int | None
    """T of the rectangular layout's [R, T] response grids; None when the batch is ragged."""

    @classmethod
    def of(cls, batch, where: str = "this node") -> "Sequences":
        import torch

        t = batch.tensors
        tokens = t.get("tokens")
        if isinstance(tokens, flowrl.Ragged):
            mask = t.get("loss_mask")
            if not isinstance(mask, flowrl.Ragged) or not mask.aligned(tokens):
                raise ValueError(f"{where}: ragged `tokens` need a `loss_mask` ragged bool tensor with the same "
                                 "offsets (True on the tokens to train on); the rollout node writes both")
            tokens, mask = tokens.to_torch(), mask.to_torch().map(lambda v: v.bool())
            lens = t.get("prompt_lens")
            lens = torch.as_tensor(lens, dtype=torch.int64) if lens is not None else _first_true(mask)
            return cls(tokens, mask, lens, None)
        if tokens is None or "response_mask" not in t:
            raise ValueError(f"{where}: the batch has neither ragged `tokens` + `loss_mask` nor rectangular `tokens` "
                             f"+ `response_mask` (it has {sorted(t)[:8]}); put a rollout node before this one")
        from flowrl.rl.tokens import rect_to_ragged

        tokens, rmask = torch.as_tensor(tokens), torch.as_tensor(t["response_mask"])
        p = tokens.shape[1] - rmask.shape[1]
        ragged, mask, _ = rect_to_ragged(tokens, p, rmask)  # padding after each response is cut
        return cls(ragged, mask, torch.full((ragged.num_samples,), p, dtype=torch.int64), rmask.shape[1])

    def per_token(self, batch, name: str, where: str = "this node"):
        """Tensor `name` of the batch as aligned ragged float32 (a [R, T] response grid is placed
        after each prompt; a [R] tensor is returned as it is: one value per sequence)."""
        import torch

        x = batch.tensors[name]
        if isinstance(x, flowrl.Ragged):
            if not x.aligned(self.tokens):
                raise ValueError(f"{where}: ragged tensor {name!r} is not aligned with `tokens` (other offsets): "
                                 "a per-token tensor needs one entry per token of every sequence")
            return x.to_torch()
        x = torch.as_tensor(x)
        if x.dim() == 1:
            return x
        from flowrl.rl.tokens import grid_to_aligned

        return grid_to_aligned(x, self._prompt_width(), self.tokens)

    def emit(self, values):
        """An aligned ragged result in the batch's own layout (a [R, T] grid for a rectangular batch)."""
        if self.padded_width is None:
            return values
        from flowrl.rl.tokens import to_rect

        return to_rect(values, self._prompt_width(), self.padded_width)

    def responses(self, pad: int):
        """[R, T] the response tokens, right-padded with `pad`; and their lengths [R]."""
        from flowrl.models.generation import response_grid

        return response_grid(self.tokens, self.prompt_lens, pad), self.tokens.lengths - self.prompt_lens

    def _prompt_width(self) -> int:
        return int(self.prompt_lens[0]) if len(self.prompt_lens) else 0


def check_fits(tokens, model, where: str, tokenizer: dict | None = None, spec=None) -> None:
    """Refuse, before any kernel runs, sequences the model cannot take: token ids outside its
    vocabulary (prompts tokenized for another model), or sequences longer than its context."""
    vocab = int(getattr(model, "vocab_size", 0) or 0)
    values = tokens.values
    if vocab and len(values) and (int(values.max()) >= vocab or int(values.min()) < 0):
        bad = int(values.max()) if int(values.max()) >= vocab else int(values.min())
        named = f" (the batch was tokenized by {tokenizer})" if tokenizer else ""
        raise ValueError(f"{where}: tensor `tokens` holds token id {bad}, outside the model's vocabulary of {vocab}"
                         f"{named}; every node must use the tokenizer of the policy's model: give the dataset "
                         "source and every model node the same `model:` (a YAML anchor under `vars:`)")
    if tokenizer and spec is not None and tokenizer.get("type") == "hf" and getattr(spec, "type", None) == "hf" \
            and str(tokenizer.get("path")) != str(spec.path):
        raise ValueError(f"{where}: the batch was tokenized by the tokenizer in {tokenizer.get('path')}, this node's "
                         f"model is {spec.path}; token ids differ between tokenizers: give the dataset source and "
                         "every model node the same `model:` (a YAML anchor under `vars:`)")
    context = _context(model)
    if context and tokens.num_samples and int(tokens.lengths.max()) > context:
        i = int(tokens.lengths.argmax())
        raise ValueError(f"{where}: sequence {i} of tensor `tokens` has {int(tokens.lengths[i])} tokens, more than "
                         f"the model's context of {context}; lower max_prompt_tokens / max_new_tokens or use a model "
                         "with a longer context (model.max_seq_len for the built-in one)")


def _context(model) -> int | None:
    spec = getattr(model, "spec", None)
    if spec is not None and getattr(spec, "max_seq_len", None):
        return int(spec.max_seq_len)
    config = getattr(getattr(model, "backbone", None), "config", None)
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) else None


def _first_true(mask):
    """Prompt lengths from a loss mask: the position of each sequence's first trained token."""
    import torch

    out = torch.zeros(mask.num_samples, dtype=torch.int64)
    for i, m in enumerate(mask):
        hit = torch.nonzero(m)
        out[i] = int(hit[0]) if len(hit) else len(m)
    return out


class OffloadsTrainer:
    """Mixin of the trainer nodes (`self.trainer`): between its turns on shared devices (`take_turns`)
    its parameters, gradients and optimizer state leave memory (host memory on a GPU, a file under
    RUN_DIR/sleep on a CPU) and come back exactly on `wake`."""

    offload: Any = None

    async def sleep(self):
        from flowrl.rl.offload import Offload, sleep_path, trainer_tensors

        if self.offload is None:
            self.offload = Offload(sleep_path(self.ctx, "trainer"))
        self.offload.put(trainer_tensors(self.trainer.model, self.trainer.optimizer))

    async def wake(self):
        if self.offload is not None:
            self.offload.take()


class ModelConfig(flowrl.NodeConfig):
    """Config of a node that holds a model."""

    model: ModelSpec = Field(default_factory=TinyLMSpec)
    """The model: `{type: tiny, d_model: 128, ...}` or `{type: hf, path: ...}`. Every node of a
    graph that holds the policy must build the same one (use a YAML anchor under `vars:`)."""


class TaskConfig(flowrl.NodeConfig):
    task: TaskSpec = Field(default_factory=ReverseSpec)
    """The procedural task: `{name: reverse | sort | add, digits: N}`."""


def sampling_temperature(batch, configured: float | None, where: str) -> float:
    """The temperature the batch was sampled at (set once, on the rollout; carried in `meta`).

    `configured` is a node's own, older `temperature` setting: None (the way to write graphs now)
    or equal to the batch's; a different value is an error, never silently two temperatures."""
    carried = batch.meta.get("temperature")
    if carried is None:
        return 1.0 if configured is None else float(configured)
    if configured is not None and float(configured) != float(carried):
        raise ValueError(
            f"{where} sets temperature={configured}, but the batch was sampled at temperature={carried} "
            "(nodes.rollout.config.temperature); delete the temperature from this node's config: it is read "
            "from the batch"
        )
    return float(carried)


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def model_on(ctx, spec, *, value_head: bool = False, trainable: bool = False):
    """Build a model for this node: same seed everywhere, so every copy starts bitwise equal."""
    import torch

    from flowrl.models import build_model

    model = build_model(spec, value_head=value_head, seed=ctx.seed)
    model = model.to(device=ctx.device)
    if ctx.dtype != "float32" and not trainable:
        model = model.to(dtype=torch_dtype(ctx.dtype))
    if not trainable:
        model.eval().requires_grad_(False)
    return model
