"""What the actor and critic trainers share: AdamW with warm-up, clipping, mini-batches, checkpoints.

A trainer owns its model, optimizer and a ``torch.Generator`` for mini-batch shuffling; its
``state_dict()`` holds all three plus the step count, so a restored trainer makes exactly the same
next update as the one that was saved (what a checkpoint/resume needs).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from flowrl.rl.config import OptimConfig


class Trainer:
    """Base class; subclasses implement ``train_step``."""

    def __init__(self, model: nn.Module, config: OptimConfig, *, seed: int = 0) -> None:
        self.model = model
        self.config = config
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay
        )
        self.generator = torch.Generator().manual_seed(seed)
        self.steps = 0
        """Optimizer steps taken (drives the warm-up)."""
        self.updates = 0
        """``train_step`` calls completed (one per batch: the policy version the actor publishes)."""

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _minibatches(self, batch_size: int) -> Iterator[torch.Tensor]:
        """Index tensors of each mini-batch, reshuffled every epoch."""
        n = self.config.mini_batches
        if n > batch_size:
            raise ValueError(f"mini_batches={n} exceeds the batch of {batch_size} rows; lower mini_batches")
        for _ in range(self.config.epochs):
            order = torch.randperm(batch_size, generator=self.generator)
            yield from order.tensor_split(n)

    def _optimizer_step(self, loss: torch.Tensor) -> float:
        """Backward, clip, step with the warm-up learning rate; returns the pre-clip gradient norm."""
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm is not None else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        self.optimizer.step()
        self.steps += 1
        return float(grad_norm)

    @property
    def lr(self) -> float:
        """Learning rate of the next optimizer step."""
        warm = self.config.warmup_steps
        return self.config.lr * min(1.0, (self.steps + 1) / warm) if warm else self.config.lr

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, shuffling RNG and counters: everything the next update depends on.

        Like ``nn.Module.state_dict()`` the tensors are the live ones: serialise (or deep-copy)
        the result before training on, e.g. ``torch.save`` in the checkpoint writer.
        """
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": self.generator.get_state(),
            "steps": self.steps,
            "updates": self.updates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (same model and config); copies, never aliases."""
        self.model.load_state_dict(state["model"])
        # Optimizer.load_state_dict keeps the given tensors when dtype and device already match;
        # a deep copy keeps this trainer from sharing moment buffers with the source.
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        self.generator.set_state(state["rng"])
        self.steps = int(state["steps"])
        self.updates = int(state["updates"])


def mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    """Average each metric over the mini-batch steps of one ``train_step``."""
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
