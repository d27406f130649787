"""Adapter (LoRA) versions in the builtin and hf engines: each serves base + B @ A bitwise, versions
never accumulate, and a version that does not apply leaves the previous one."""

from __future__ import annotations

import pytest
import torch

from flowrl.engines import Sampling, build_engine
from flowrl.tasks import EOS, PAD
from flowrl.transport.ragged import Ragged
from flowrl.weights import layout_of, weights_digest
from flowrl.weights.adapters import merged
from tests.weights.adapter_peers import random_adapters

pytestmark = pytest.mark.timeout(300)
TARGETS = {"builtin": ("attn.qkv", "attn.proj"), "hf": ("q_proj", "k_proj", "v_proj", "o_proj")}
PROMPTS = Ragged.from_sequences([[1, 5, 6, 9], [1, 7, 9], [1, 4, 4, 8, 2]])


@pytest.fixture(params=["builtin", "hf"])
def engine(request, tiny_llama):
    model = {"type": "tiny"} if request.param == "builtin" else {"type": "hf", "path": tiny_llama}
    return build_engine({"type": request.param}, model=model, seed=0), model


def digest(tensors: dict) -> str:
    return weights_digest(tensors, layout_of(tensors))


def greedy(engine) -> torch.Tensor:
    s = Sampling(n=1, temperature=0.0, max_new_tokens=6, eos_id=EOS, pad_id=PAD)
    return engine.generate(PROMPTS, s, seed=0).tokens.values


def test_after_each_adapter_version_the_engine_serves_base_plus_b_a_bitwise(engine):
    engine, model = engine
    targets = TARGETS[engine.type]
    base = {k: v.clone() for k, v in engine.weights().items()}
    reference = build_engine({"type": engine.type}, model=model, seed=0)  # loaded with the merged full weights
    versions = [random_adapters(base, seed=v, targets=targets) for v in (1, 2)]
    versions.append(random_adapters(base, seed=3, targets=targets[:1]))  # the others go back to their base
    for v, adapters in enumerate(versions, start=1):
        engine.load_weights(adapters.items(), v)
        want = merged(base, adapters)
        assert engine.version == v and digest(engine.weights()) == digest(want), f"version {v}"
        reference.load_weights(want.items(), v)
        assert torch.equal(greedy(engine), greedy(reference))
    assert set(engine.adapted.base) == {k for k in base if targets[0] in k and k.endswith(".weight")
                                        and base[k].dim() == 2}  # base copies of adapted weights only


def test_a_garbled_adapter_version_leaves_the_previous_one_intact(engine):
    engine, _ = engine
    targets = TARGETS[engine.type]
    base = {k: v.clone() for k, v in engine.weights().items()}
    one = random_adapters(base, seed=1, targets=targets)
    engine.load_weights(one.items(), 1)
    held = digest(engine.weights())
    last_a = sorted(k for k in one if k.endswith(".lora_A"))[-1]  # the last pair applied: the others came first
    garbled = {
        "shape": ({**one, last_a: torch.zeros(4, 3)}, ValueError, "does not fit|do not fit"),
        "half": ({k: v for k, v in one.items() if k != last_a}, ValueError, "is incomplete"),
        "unknown": ({**one, "nope.lora_A": torch.zeros(4, 3), "nope.lora_B": torch.zeros(3, 4)}, KeyError,
                    "'nope.weight'"),
        "mixed": ({**one, next(iter(base)): next(iter(base.values()))}, ValueError, "mixes adapter tensors"),
    }
    for what, (bad, error, match) in garbled.items():
        with pytest.raises(error, match=match):
            engine.load_weights(bad.items(), 2)
        assert engine.version == 1 and digest(engine.weights()) == held, what
    two = random_adapters(base, seed=2, targets=targets)
    engine.load_weights(two.items(), 2)
    assert digest(engine.weights()) == digest(merged(base, two))


def test_a_full_version_after_adapters_is_the_new_base(engine):
    engine, _ = engine
    targets = TARGETS[engine.type]
    base = {k: v.clone() for k, v in engine.weights().items()}
    engine.load_weights(random_adapters(base, seed=1, targets=targets).items(), 1)
    g = torch.Generator().manual_seed(5)
    full = {k: torch.randn(v.shape, generator=g).to(v.dtype) * 0.1 for k, v in base.items()}
    engine.load_weights(full.items(), 2)
    assert digest(engine.weights()) == digest(full) and not engine.adapted.base
    three = random_adapters(full, seed=3, targets=targets)
    engine.load_weights(three.items(), 3)
    assert digest(engine.weights()) == digest(merged(full, three))
