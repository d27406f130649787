"""Models: the built-in tiny transformer and the Hugging Face adapter, behind one factory.

    >>> policy = build_model({"type": "tiny", "d_model": 64}, seed=0)
    >>> critic = build_model({"type": "tiny", "d_model": 64}, value_head=True, seed=0)
    >>> out = generate(policy, prompts, max_new_tokens=5, eos_id=EOS)     # doctest: +SKIP
    >>> out.tokens, out.loss_mask, out.logprobs    # Ragged, aligned: prompt + response  # doctest: +SKIP
    >>> lp = packed_logprobs(policy, out.tokens)   # aligned with out.tokens   # doctest: +SKIP
    >>> v = packed_values(critic, out.tokens)      # aligned with out.tokens   # doctest: +SKIP

``prompts`` is a :class:`~flowrl.transport.ragged.Ragged` (each prompt its own length) or a
``[B, P]`` tensor of full rows. The rectangular helpers (``token_logprobs``, ``values``) still read
``[B, P + T]`` grids whose prompts all have ``P`` tokens.

The specs import without torch (the graph loader and ``flowrl check`` use them); everything else
loads torch on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flowrl.models.spec import MODEL_TYPES, HFModelSpec, ModelSpec, TinyLMSpec, parse_model_spec

if TYPE_CHECKING:
    from flowrl.models.base import CausalLM

__all__ = [
    "MODEL_TYPES", "HFModelSpec", "ModelSpec", "TinyLMSpec", "parse_model_spec", "build_model",
    "CausalLM", "Generation", "generate", "token_logprobs", "token_logprobs_and_entropy", "values",
    "entropy_from_logits", "logprobs_from_logits", "packed_logprobs", "packed_values", "plan_microbatches",
]

_LAZY = {
    "CausalLM": "flowrl.models.base",
    "Generation": "flowrl.models.generation",
    "generate": "flowrl.models.sampling",
    "token_logprobs": "flowrl.models.sampling",
    "token_logprobs_and_entropy": "flowrl.models.sampling",
    "values": "flowrl.models.sampling",
    "entropy_from_logits": "flowrl.models.sampling",
    "logprobs_from_logits": "flowrl.models.sampling",
    "packed_logprobs": "flowrl.models.packing",
    "packed_values": "flowrl.models.packing",
    "plan_microbatches": "flowrl.models.packing",
}


def build_model(spec: Any, value_head: bool = False, *, seed: int = 0) -> "CausalLM":
    """A policy, or with ``value_head=True`` a critic, for a spec or a mapping keyed on ``type``.

    ``seed`` fixes the initialisation of the built-in model (ignored by ``hf``, whose weights come
    from its folder, apart from a critic's fresh value head): build the policy with the same seed
    in every process and all copies start bitwise equal.
    """
    spec = parse_model_spec(spec)
    if spec.type == "tiny":
        from flowrl.models.tiny import TinyLM

        return TinyLM(spec, value_head=value_head, seed=seed)
    from flowrl.models.hf import load_hf_model

    return load_hf_model(spec, value_head=value_head, seed=seed)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'flowrl.models' has no attribute {name!r}")
