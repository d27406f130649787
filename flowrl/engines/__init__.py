"""Rollout engines: what generates the completions of a rollout node, behind one factory.

    >>> engine = build_engine({"type": "builtin"}, model={"type": "tiny"}, device="cpu", seed=0)
    >>> out = engine.generate(prompts, Sampling(n=4, temperature=1.0, max_new_tokens=5,
    ...                                         eos_id=EOS, pad_id=PAD), seed=0)   # doctest: +SKIP

``builtin`` (flowrl's own sampler, any flowrl model), ``hf`` (``transformers``' generate) and
``vllm`` (a vLLM engine in the rollout process). The specs import without torch (the graph loader
uses them); a backend's module is imported when an engine of its type is built.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from flowrl.engines.spec import (
    ENGINE_TYPES,
    BuiltinEngineSpec,
    EngineSpec,
    HFEngineSpec,
    VLLMEngineSpec,
    parse_engine_spec,
)

if TYPE_CHECKING:
    from flowrl.engines.base import RolloutEngine

__all__ = [
    "ENGINE_TYPES", "BuiltinEngineSpec", "EngineSpec", "HFEngineSpec", "VLLMEngineSpec", "parse_engine_spec",
    "build_engine", "RolloutEngine", "Sampling",
]

_BACKENDS = {
    "builtin": "flowrl.engines.builtin:BuiltinEngine",
    "hf": "flowrl.engines.hf:HFEngine",
    "vllm": "flowrl.engines.vllm:VLLMEngine",
}


ON_NEW_WEIGHTS = ("keep", "restart", "finish")


def build_engine(spec: Any, *, model: Any, device: str = "cpu", dtype: str = "float32", seed: int = 0,
                 devices: Any = (), on_new_weights: str = "finish") -> "RolloutEngine":
    """The engine of ``spec`` (a spec or a mapping keyed on ``type``) running ``model``;
    ``on_new_weights`` (keep | restart | finish, see ``RolloutEngine.on_new_weights``) is set on the
    engine once it is built, so a backend need not take it as an argument."""
    if on_new_weights not in ON_NEW_WEIGHTS:
        raise ValueError(f"on_new_weights={on_new_weights!r}; choose one of {', '.join(ON_NEW_WEIGHTS)}")
    spec = parse_engine_spec(spec)
    module, _, cls = _BACKENDS[spec.type].partition(":")
    engine_cls = getattr(importlib.import_module(module), cls)
    engine = engine_cls(spec, model=model, device=device, dtype=dtype, seed=seed, devices=devices)
    engine.on_new_weights = on_new_weights
    return engine


def __getattr__(name: str) -> Any:
    if name in ("RolloutEngine", "Sampling"):
        return getattr(importlib.import_module("flowrl.engines.base"), name)
    raise AttributeError(f"module 'flowrl.engines' has no attribute {name!r}")
