"""Nodes for an adapter-version run (tests/weights/test_adapter_run.py): a trainer that publishes only
LoRA adapters, and followers that check, on every batch, that they hold base + B @ A of the version
they say they hold -- one whose weights the runtime's subscriber adapts, one that applies them itself."""

from __future__ import annotations

import flowrl
from flowrl.testing.nodes import Collect

SHAPE, RANK = (24, 16), 4


def base():
    import torch

    return torch.randn(*SHAPE, generator=torch.Generator().manual_seed(0))


def adapters(version: int) -> dict:
    """The trainer's adapter version `version` (deterministic: every process computes the same)."""
    import torch

    g = torch.Generator().manual_seed(100 + version)
    b = torch.randn(SHAPE[0], RANK, generator=g) if version else torch.zeros(SHAPE[0], RANK)  # LoRA starts at B = 0
    return {"l.lora_A": torch.randn(RANK, SHAPE[1], generator=g), "l.lora_B": b}


class AdapterTrainer(Collect):
    """After each batch its adapters are those of the new version; it publishes only them."""

    publishes_weights = True

    async def setup(self):
        await super().setup()
        self.adapters = adapters(0)

    async def process(self, batch, port):
        await super().process(batch, port)
        self.adapters.update(adapters(self.ctx.policy_version + 1))

    def weights(self):
        return self.adapters


class AdapterFollower(flowrl.Node):
    """Holds a full weight `l.weight` (the base, before any version); checks on every batch that it
    is base + B @ A of the version it holds."""

    subscribes_weights = True

    async def setup(self):
        from flowrl.weights.adapters import AdaptedWeights

        self.w = {"l.weight": base()}
        self.version, self.adapted = 0, AdaptedWeights()

    def weights(self):
        return self.w

    def load_weights(self, tensors, version):
        self.version = version

    async def process(self, batch, port):
        import torch

        from flowrl.weights.adapters import merged

        want = merged({"l.weight": base()}, adapters(self.version))
        if not torch.equal(self.w["l.weight"], want["l.weight"]):
            raise RuntimeError(f"the weights are not base + B @ A of version {self.version}")
        return batch.replace(policy_version=self.version)


class SelfApplying(AdapterFollower):
    """Gets adapter versions as they came (`applies_adapters`) and applies them itself."""

    applies_adapters = True

    def load_weights(self, tensors, version):
        assert sorted(tensors) == ["l.lora_A", "l.lora_B"], sorted(tensors)
        self.adapted.apply(self.w, tensors)
        self.version = version
