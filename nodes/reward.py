"""Reward: scores each response — with a task's rule, any `module:function`, or a reward model."""

import importlib

from pydantic import Field

import flowrl
from flowrl.nodes.common import ModelConfig, Sequences, TaskConfig, check_fits, model_on


class Reward(flowrl.Node):
    """Rule-based reward: the task's verifiable score (partial credit in [0, 1]), or your function
    `fn(responses [B,T], targets [B,A], batch) -> scores [B]` given as `function: pkg.mod:fn`
    (responses right-padded with the task's PAD after their own end)."""

    requires = {"tokens": "int64", "targets": "int64"}

    role = "reward"

    class Config(TaskConfig):
        function: str | None = None
        """Optional `module:function` that scores instead of the task."""

    async def setup(self):
        from flowrl.tasks import build_task

        if self.config.function:
            module, _, name = self.config.function.partition(":")
            try:
                self.fn = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError) as e:
                raise ValueError(f"reward function {self.config.function!r} cannot be loaded: {e}; "
                                 "give it as 'package.module:function'") from None
        else:
            task = build_task(self.config.task)
            self.fn = lambda responses, targets, batch: task.score(responses, targets)

    async def process(self, batch, port):
        import torch

        from flowrl.tasks import PAD

        responses, _ = Sequences.of(batch, f"node `{self.ctx.name}`").responses(PAD)
        scores = torch.as_tensor(self.fn(responses, batch.tensors["targets"], batch), dtype=torch.float32)
        self.ctx.recorder.mean("score", float(scores.mean()), weight=len(scores), per_node=True)
        return batch.replace(tensors={**batch.tensors, "scores": scores})


class RewardModel(flowrl.Node):
    """Scores with a model: the value head's output at the last token of each sequence (prompt and
    response, packed: no padding). `checkpoint` loads trained weights (a state dict saved with torch.save)."""

    role = "reward"

    class Config(ModelConfig):
        checkpoint: str | None = None
        scale: float = Field(1.0)

    async def setup(self):
        import torch

        self.model = model_on(self.ctx, self.config.model, value_head=True)
        if self.config.checkpoint:
            self.model.load_state_dict(torch.load(self.config.checkpoint, map_location="cpu", weights_only=True))

    async def process(self, batch, port):
        import torch

        where = f"node `{self.ctx.name}`"
        seqs = Sequences.of(batch, where)
        tokens = seqs.tokens
        check_fits(tokens, self.model, where, batch.meta.get("tokenizer"), self.config.model)
        with torch.no_grad():
            out = self.model.forward_packed(tokens.values.to(self.ctx.device), tokens.offsets.to(self.ctx.device))
        ends = (tokens.offsets[1:] - 1).clamp(min=0)
        scores = out.float().cpu()[ends] * self.config.scale
        self.ctx.recorder.mean("score", float(scores.mean()), weight=len(scores), per_node=True)
        return batch.replace(tensors={**batch.tensors, "scores": scores})
