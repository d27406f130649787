"""Trajectories -> the batch the GRPO / PPO nodes take (the rollout's ragged layout, see nodes/common.py).

    >>> batch = trajectories_to_batch(trajs, samples_per_prompt=4, temperature=1.0, top_p=1.0)  # doctest: +SKIP
    >>> batch.tensors["tokens"]        # Ragged int64: one whole episode per sample
    >>> batch.tensors["loss_mask"]     # Ragged bool, aligned: True on the model's tokens (holes between turns)

One sample per episode, in the order given (task i's n samples contiguous, as the rollout lays out
a prompt group, so ``group_advantages`` normalises within a task). Tensors:

- ``tokens``, ``loss_mask``, ``logprobs`` (float32), ``versions`` (int64, -1 off model tokens):
  ragged and aligned -- exactly the trajectory's lists;
- ``prompt_lens`` [R] int64: the first prompt's length (the rest of the episode is the "response",
  environment turns included: the loss mask, not the prompt length, says what is trained on);
- ``scores`` [R] float32: the episode's reward; ``turns`` and ``tool_calls`` [R] int64.

Meta: ``samples_per_prompt``, ``temperature``, ``top_p`` (what the trainer recomputes log-probs
at: what the generator reported in each trajectory's ``info``, else the arguments, else 1.0), ``finishes`` ({finish: count}) and whatever ``extra_meta`` adds. ``policy_version``: the
oldest version among the model's tokens (a group is as stale as its oldest token), or
``default_version`` when no model token was generated.

An episode that ended before its first prompt (its environment's ``reset`` raised or hung) has no
tokens; it becomes one ``filler`` token off the loss mask: it keeps its place in its task's group,
trains on nothing, and its reward (the ``error_reward``) counts in its group's baseline.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from flowrl.agents.base import Trajectory


def trajectories_to_batch(trajs: Sequence[Trajectory], samples_per_prompt: int, temperature: float | None = None,
                          top_p: float | None = None, extra_meta: dict[str, Any] | None = None, *,
                          default_version: int = 0, filler: int = 0):
    import torch

    import flowrl

    if samples_per_prompt < 1 or len(trajs) % samples_per_prompt:
        raise ValueError(f"{len(trajs)} trajectories do not make groups of samples_per_prompt={samples_per_prompt}")
    trajs = [t if t.tokens else _filled(t, filler) for t in trajs]
    for i, t in enumerate(trajs):
        if not (len(t.tokens) == len(t.mask) == len(t.logprobs) == len(t.versions)):
            raise ValueError(f"trajectory {i}'s lists are out of line: {len(t.tokens)} tokens, "
                             f"{len(t.mask)} mask, {len(t.logprobs)} log-probs, {len(t.versions)} versions")
    temperature = _sampled(trajs, "temperature", temperature)
    top_p = _sampled(trajs, "top_p", top_p)
    tokens = flowrl.Ragged.from_sequences([t.tokens for t in trajs], "int64")
    mask = tokens.like(torch.tensor([m for t in trajs for m in t.mask], dtype=torch.bool))
    logprobs = tokens.like(torch.tensor([x for t in trajs for x in t.logprobs], dtype=torch.float32))
    versions = tokens.like(torch.tensor([v for t in trajs for v in t.versions], dtype=torch.int64))
    generated = versions.values[mask.values & (versions.values >= 0)]
    version = int(generated.min()) if generated.numel() else default_version
    finishes = Counter(t.finish for t in trajs)
    meta = {**(extra_meta or {}), "samples_per_prompt": samples_per_prompt, "temperature": temperature,
            "top_p": top_p, "finishes": dict(sorted(finishes.items()))}
    return flowrl.Batch(
        tensors={
            "tokens": tokens, "loss_mask": mask, "logprobs": logprobs, "versions": versions,
            "prompt_lens": torch.tensor([t.prompt_len for t in trajs], dtype=torch.int64),
            "scores": torch.tensor([t.reward for t in trajs], dtype=torch.float32),
            "turns": torch.tensor([t.turns for t in trajs], dtype=torch.int64),
            "tool_calls": torch.tensor([t.tool_calls for t in trajs], dtype=torch.int64),
        },
        meta=meta,
        policy_version=version,
    )


def _filled(t: Trajectory, filler: int) -> Trajectory:
    from dataclasses import replace

    return replace(t, tokens=[int(filler)], mask=[False], logprobs=[0.0], versions=[-1], prompt_len=1)


def _sampled(trajs: Sequence[Trajectory], key: str, given: float | None) -> float:
    """The sampling setting the generator reported (``info[key]``), else ``given``, else 1.0; one
    batch, one setting (the trainer recomputes log-probs at it)."""
    seen = {float(t.info[key]) for t in trajs if key in t.info}
    if len(seen) > 1:
        raise ValueError(f"the episodes of one batch were sampled at different {key} values {sorted(seen)}; "
                         "give every rollout replica the same sampling settings")
    if seen:
        return seen.pop()
    return 1.0 if given is None else float(given)
