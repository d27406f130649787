"""Actor: the policy update (PPO clipped objective, KL, entropy; GRPO with group advantages).

The training sink of the PPO and GRPO graphs. The runtime hands it tickets in order, so update n
consumes ticket n, generated with weights of version >= n - max_staleness; after each update it
publishes version n + 1 to the rollouts over the weight-sync group.

With `train.lora` (a Hugging Face model only) the actor trains low-rank adapters on the frozen base
and publishes the adapters alone (`flowrl.models.lora.adapter_weights`; docs/lora.md).
"""

from pydantic import Field, model_validator

import flowrl
from flowrl.nodes.common import ModelConfig, OffloadsTrainer, Sequences, check_fits, model_on
from flowrl.rl import ActorConfig


class Actor(OffloadsTrainer, flowrl.Sink):
    role = "actor"
    requires = {"tokens": "int64", "logprobs": "float32", "advantages": "float32", "scores": "float32"}
    stateful = True
    publishes_weights = True

    class Config(ModelConfig):
        train: ActorConfig = Field(default_factory=ActorConfig)
        """Optimizer, clipping, KL loss and entropy settings; `train.lora` for LoRA."""

        @model_validator(mode="after")
        def _lora_needs_a_pretrained_base(self):
            if self.train.lora is not None and self.model.type != "hf":
                raise ValueError(
                    f"train.lora adapts a pretrained base, but model.type is {self.model.type!r} (trained from "
                    "scratch): use `model: {type: hf, path: ...}`, or remove train.lora to train the whole model")
            return self

    async def setup(self):
        from flowrl.rl import ActorTrainer

        from flowrl.rl import FullState

        model = model_on(self.ctx, self.config.model, trainable=True)
        self.trainer = ActorTrainer(model, self.config.train, seed=self.ctx.seed)
        self.published = None  # what a version holds: the full state, or (LoRA) the adapters only
        if self.config.train.lora is not None:
            from flowrl.models.lora import adapter_weights

            self.published = adapter_weights
        # data parallel (devices: N): the weights are gathered one tensor at a time to publish
        self.full_state = FullState(self.trainer.model, state=self.published) if self.ctx.world_size > 1 else None

    def weights(self):
        if self.full_state is not None:
            return self.full_state
        if self.published is not None:
            return self.published(self.trainer.model)
        return {k: v.detach() for k, v in self.trainer.model.state_dict().items()}

    async def process(self, batch, port):
        t = batch.tensors
        where = f"node `{self.ctx.name}`"
        seqs = Sequences.of(batch, where)
        check_fits(seqs.tokens, self.trainer.model, where, batch.meta.get("tokenizer"), self.config.model)
        ref = seqs.per_token(batch, "ref_logprobs", where) if "ref_logprobs" in t else None
        metrics = self.trainer.train_step(tokens=seqs.tokens, loss_mask=seqs.loss_mask,
                                          old_logprobs=seqs.per_token(batch, "logprobs", where),
                                          advantages=seqs.per_token(batch, "advantages", where),
                                          ref_logprobs=ref, temperature=batch.meta.get("temperature"))
        rec = self.ctx.recorder
        scores = t["scores"]
        rec.mean("reward", float(scores.mean()), weight=len(scores))
        rec.count("samples", len(scores))
        rec.count("tokens", seqs.tokens.total)
        if "versions" in t:
            self.record_versions(seqs, batch, rec)
        for k, v in metrics.items():
            base, _, reduction = k.rpartition("_")
            if k.startswith(("mismatch_", "rollout_is_")) and reduction in ("mean", "max"):
                getattr(rec, reduction)(base, float(v))  # named with its reduction: mismatch_logprob_abs_max
            else:
                rec.mean(k, float(v))

    def record_versions(self, seqs, batch, rec) -> None:
        """Per-token versions (a rollout whose weights changed mid-generation): how many versions the
        oldest generated token of this update is behind (`token_staleness`), and how many samples
        hold tokens of more than one version (`partial_samples`)."""
        import torch

        versions = batch.tensors["versions"]
        if not isinstance(versions, flowrl.Ragged) or versions.total != seqs.tokens.total:
            return  # not aligned with the tokens (a user's layout): nothing to say
        values = versions.to_torch().values.to(torch.int64)
        gen = seqs.loss_mask.values.bool() & (values >= 0)
        if not bool(gen.any()):
            return
        ids, v = seqs.tokens.sample_ids()[gen], values[gen]
        n = seqs.tokens.num_samples
        big = torch.iinfo(torch.int64).max
        low = torch.full((n,), big, dtype=torch.int64).scatter_reduce(0, ids, v, "amin")
        high = torch.full((n,), -1, dtype=torch.int64).scatter_reduce(0, ids, v, "amax")
        rec.max("token_staleness", self.ctx.policy_version - int(low[low < big].min()))
        rec.count("partial_samples", int(((high > low) & (low < big)).sum()))

    def state_dict(self):
        return self.trainer.state_dict()

    def load_state_dict(self, state):
        self.trainer.load_state_dict(state)
