"""Pieces the built-in role nodes share: config fields and the tensors they pass along.

A batch that flows through the PPO / GRPO graphs carries, as it grows:

    prompts   tokens-to-be: prompts [B, P] int64, targets [B, A] int64     (meta: prompt_len, max_new_tokens)
    rollout   + tokens [B, P+T] int64, response_mask [B, T] bool, logprobs [B, T] float32
                (meta: samples_per_prompt, temperature, top_p, rollout_engine)
    reward    + scores [B] float32
    reference + ref_logprobs [B, T] float32
    critic    + values [B, T], advantages [B, T], returns [B, T]
    advantages (GRPO) + advantages [B, T]
"""

from __future__ import annotations

from pydantic import Field

import flowrl
from flowrl.models import ModelSpec, TinyLMSpec
from flowrl.tasks import ReverseSpec, TaskSpec


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
