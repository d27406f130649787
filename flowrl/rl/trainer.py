"""What the actor and critic trainers share: AdamW with warm-up, clipping, mini-batches, checkpoints.

A trainer owns its model, optimizer and a ``torch.Generator`` for mini-batch shuffling; its
``state_dict()`` holds all three plus the step count, so a restored trainer makes exactly the same
next update as the one that was saved (what a checkpoint/resume needs).

When torch.distributed is initialised with more than one rank (a node with ``devices: N``), the
trainer is data parallel over that group (or the ``group`` given): the model is sharded with FSDP2,
each rank trains on its shard of every batch, and N ranks make the update one rank makes on the
concatenated batch (see ``flowrl.rl.parallel`` and docs/data-parallel.md). Every rank must call
``train_step`` (and the critic's ``values``) for every batch, an empty shard included.

Sequences are of their own length (``Ragged``, see docs/packing.md): a mini-batch is a set of
sequences, cut into micro-batches of at most ``max_tokens_per_microbatch`` tokens (packed, no
padding); gradients accumulate over them, each token weighted with the mini-batch's global
denominators (:func:`flowrl.rl.losses.loss_weights`), and one optimizer step ends the mini-batch.
Data parallel, every rank runs as many passes as the rank with the most micro-batches (one-token
dummy passes with a zero loss), so the collectives of FSDP stay matched.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from flowrl.models.packing import dummy_forward, nonempty_plan
from flowrl.rl.config import OptimConfig
from flowrl.rl.tokens import TokenBatch
from flowrl.rl.parallel import (
    DataParallel,
    load_local_model_state,
    local_rows,
    local_state,
    shard_optimizer_state,
)


class Trainer:
    """Base class; subclasses implement ``train_step``."""

    def __init__(self, model: nn.Module, config: OptimConfig, *, seed: int = 0, group: Any = None,
                 trainable_only: bool = False) -> None:
        self.saved_names = {n for n, p in model.named_parameters() if p.requires_grad} if trainable_only else None
        """None: checkpoints hold the whole model. A set (LoRA): only these entries, the trainable ones."""
        self.dp = DataParallel(group)
        """The ranks this trainer spans (``dp.enabled`` when more than one)."""
        self.model = self.dp.shard(model)
        self.config = config
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay,
            **_fast_adamw(self.params),
        )
        self.generator = torch.Generator().manual_seed(seed)
        if self.dp.enabled:  # one permutation on every rank, whatever seed each was given
            self.generator.set_state(self.dp.from_rank0(self.generator.get_state()))
        self.steps = 0
        """Optimizer steps taken (drives the warm-up)."""
        self.updates = 0
        """``train_step`` calls completed (one per batch: the policy version the actor publishes)."""

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _minibatches(self, batch_size: int) -> Iterator[torch.Tensor]:
        """Local index tensors of each mini-batch, reshuffled every epoch.

        ``batch_size`` is this rank's shard. The permutation is over the whole batch (every rank's
        shard, concatenated in rank order) and the same on every rank; a rank's mini-batch ``i`` is
        its own rows of the 1-rank mini-batch ``i`` (possibly none).
        """
        sizes = self.dp.sizes(batch_size)
        total, offset = sum(sizes), sum(sizes[: self.dp.rank])
        n = self.config.mini_batches
        if n > total:
            raise ValueError(f"mini_batches={n} exceeds the batch of {total} rows; lower mini_batches")
        for _ in range(self.config.epochs):
            order = torch.randperm(total, generator=self.generator)
            for part in order.tensor_split(n):
                yield local_rows(part, offset, batch_size) if self.dp.enabled else part

    def _plan(self, batch: TokenBatch, idx: torch.Tensor, seq_valid: torch.Tensor,
              where: str) -> tuple[list[list[int]], int, float, float]:
        """``(micro-batches, passes, tokens, sequences)`` of the mini-batch of this rank's sequences ``idx``.

        Micro-batches hold batch positions (first-fit decreasing by length into the token budget;
        sequences of no tokens are left out). ``passes``: the most micro-batches any rank has (every
        rank runs that many forward/backward passes). ``tokens``: the mini-batch's valid tokens
        (``seq_valid [B]`` summed over ``idx``), ``sequences``: its sequences, both over all ranks.
        """
        local = idx.tolist()
        plan = [[local[i] for i in b]
                for b in nonempty_plan(batch.lengths[local], self.config.max_tokens_per_microbatch, where, self.model)]
        n_tok, n_seq = float(seq_valid[idx.to(seq_valid.device)].sum()) if local else 0.0, float(len(local))
        if not self.dp.enabled:
            return plan, len(plan), n_tok, n_seq
        counts = torch.zeros(2 + self.dp.world_size, dtype=torch.float64)
        counts[0], counts[1], counts[2 + self.dp.rank] = n_tok, n_seq, len(plan)
        total = self.dp.all_sum(counts)  # one all-reduce: both totals and every rank's count
        return plan, int(total[2:].max()), float(total[0]), float(total[1])

    def _check_budget(self, lengths: np.ndarray, where: str) -> None:
        """Refuse a sequence longer than the micro-batch budget on every rank at once (no rank left waiting)."""
        budget = self.config.max_tokens_per_microbatch
        if budget is None:
            return
        longest = int(self.dp.all_max(float(lengths.max()) if len(lengths) else 0.0))
        if longest <= budget:
            return
        over = np.flatnonzero(lengths > budget)
        which = f"sequence {int(over[0])} of the batch has {int(lengths[over[0]])} tokens" if len(over) else \
            f"a sequence of another rank's shard has {longest} tokens"
        raise ValueError(f"{where}: {which}, more than max_tokens_per_microbatch={budget}; raise "
                         f"max_tokens_per_microbatch to at least {longest} (or lower the prompt / response length "
                         "caps)")

    def _passes(self, n: int) -> int:
        """The most of every rank's ``n`` (passes of a no-grad packed pass every rank runs)."""
        return int(self.dp.all_max(float(n))) if self.dp.enabled else n

    def _micro(self, batch: Any, plan: list, passes: int) -> Iterator[Any]:
        """The micro-batches of a mini-batch (``batch.take`` of each planned part), then dummy passes
        up to ``passes``: every rank runs as many as the rank with the most."""
        for k in range(passes):
            if k < len(plan):
                yield batch.take(plan[k])
            else:
                self._dummy_pass()

    def _dummy_pass(self) -> None:
        """A backward of zero that joins the collectives of a real micro-batch (this rank has no more)."""
        self._backward(dummy_forward(self.model, self.device).float().sum() * 0.0)

    def _backward(self, loss: torch.Tensor) -> None:
        """Accumulate ``loss``'s gradient. Data parallel, FSDP averages gradients over the ranks and each rank's
        loss is its part of the global sum, so it is scaled by the world size: the sum of the parts' gradients."""
        (loss * self.dp.world_size if self.dp.enabled else loss).backward()

    def _optimizer_step(self) -> float:
        """Clip the accumulated gradient, step with the warm-up learning rate, clear the gradient; returns
        the pre-clip gradient norm."""
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm is not None else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)  # sharded: the global norm
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return float(grad_norm)

    @property
    def lr(self) -> float:
        """Learning rate of the next optimizer step (0-based ``k = self.steps``): warm-up ``lr * (k + 1) / W``
        for ``k < W``, then ``lr``, or with ``lr_decay_steps = N`` ``lr * (N - k) / (N - W)`` (0 from ``N`` on)."""
        cfg, k = self.config, self.steps
        warm = cfg.warmup_steps
        if k < warm:
            return cfg.lr * (k + 1) / warm
        if cfg.lr_decay_steps is None:
            return cfg.lr
        return cfg.lr * max(0.0, (cfg.lr_decay_steps - k) / (cfg.lr_decay_steps - warm))

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, shuffling RNG and counters: everything the next update depends on.

        Like ``nn.Module.state_dict()`` the tensors are the live ones: serialise (or deep-copy)
        the result before training on, e.g. ``torch.save`` in the checkpoint writer.

        Data parallel: each rank returns its own shard of model and optimizer (plain tensors, so
        ``torch.load(weights_only=True)`` reads it) and ``ranks``; each rank loads its own file
        back, with the same number of ranks. The generator is the same on every rank.
        """
        model = self.model.state_dict()
        if self.saved_names is not None:
            model = {k: v for k, v in model.items() if k in self.saved_names}
        state = {
            "model": model,
            "optimizer": self.optimizer.state_dict(),
            "rng": self.generator.get_state(),
            "steps": self.steps,
            "updates": self.updates,
        }
        if self.dp.enabled:
            state = {**local_state(state), "ranks": [self.dp.rank, self.dp.world_size]}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (same model and config); copies, never aliases."""
        ranks = list(state.get("ranks", [0, 1]))
        if ranks != [self.dp.rank, self.dp.world_size]:
            raise ValueError(f"checkpoint was saved by rank {ranks[0]} of {ranks[1]}, this is rank {self.dp.rank} "
                             f"of {self.dp.world_size}: resume with the devices the checkpoint was saved with")
        # Optimizer.load_state_dict keeps the given tensors when dtype and device already match;
        # a deep copy keeps this trainer from sharing moment buffers with the source.
        optimizer = copy.deepcopy(state["optimizer"])
        if self.dp.enabled:
            load_local_model_state(self.model, state["model"], only=self.saved_names)
            optimizer = shard_optimizer_state(self.optimizer, optimizer)
        elif self.saved_names is None:
            self.model.load_state_dict(state["model"])
        else:
            saved = state["model"]
            if saved.keys() != self.saved_names:
                raise ValueError(f"checkpoint does not fit the model's trainable part: missing "
                                 f"{sorted(self.saved_names - saved.keys())[:3]}, unexpected "
                                 f"{sorted(saved.keys() - self.saved_names)[:3]}; load a checkpoint of the same "
                                 "model and LoRA config")
            self.model.load_state_dict(saved, strict=False)
        self.optimizer.load_state_dict(optimizer)
        self.generator.set_state(state["rng"])
        self.steps = int(state["steps"])
        self.updates = int(state["updates"])


def mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    """Average each metric over the mini-batch steps of one ``train_step``."""
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}


def _fast_adamw(params: list) -> dict[str, bool]:
    """AdamW's one-kernel (``fused``) step where torch has it for these parameters: plain tensors on
    the CPU or CUDA (torch >= 2.4 on the CPU). Else its default. On a small model the per-tensor loop
    costs more than the arithmetic: 0.5 ms instead of 4 ms a step on the GRPO benchmark's model."""
    plain = all(type(p) is torch.nn.Parameter and p.device.type in ("cpu", "cuda") and p.is_floating_point()
                for p in params)
    if not plain or not params:
        return {}
    try:
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1, device=params[0].device))], fused=True)
    except (RuntimeError, TypeError, ValueError):
        return {}
    return {"fused": True}
