"""Token budgets: `token-budget` (warning) when a node that packs sequences into micro-batches of
`max_tokens_per_microbatch` tokens could be handed a longer sequence than that.

The longest sequence the graph allows is the node's model context (the built-in model's
`max_seq_len`, a Hugging Face config's `max_position_embeddings`), lowered to prompt cap +
response budget when the graph states both (`max_prompt_tokens` of a dataset source and the
`max_new_tokens` it or the rollout sets). A sequence longer than the budget stops the node with an
error naming it; better to learn it from `flowrl check` than an hour into a run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flowrl.graph.spec import GraphSpec
from flowrl.placement.findings import Finding


def token_budget(node_config: dict, cls: type | None) -> int | None:
    """The node's `max_tokens_per_microbatch` (its own or, for a trainer, under `train:`), default
    included; None when it has none or packs everything at once."""
    config = _config(node_config, cls)
    for where in (config, getattr(config, "train", None)):
        value = getattr(where, "max_tokens_per_microbatch", None) if where is not None else None
        if isinstance(value, int):
            return value
    return None


def _config(node_config: dict, cls: type | None) -> Any:
    try:
        return cls.Config(**node_config) if cls is not None and hasattr(cls, "Config") else None
    except Exception:  # a bad config is the node's own error, reported by the loader
        return None


def model_context(node_config: dict, cls: type | None) -> int | None:
    """Tokens the node's model takes at most (None: unknown)."""
    model = getattr(_config(node_config, cls), "model", None)
    if model is None:
        return None
    if getattr(model, "type", None) == "tiny":
        return int(model.max_seq_len)
    path = Path(str(getattr(model, "path", ""))) / "config.json"
    try:
        if path.is_file() and path.stat().st_size < 1 << 20:
            value = json.loads(path.read_text(encoding="utf-8")).get("max_position_embeddings")
            return int(value) if isinstance(value, int) and value > 0 else None
    except (OSError, ValueError):
        return None
    return None


def _caps(spec: GraphSpec) -> int | None:
    """prompt cap + response budget, when the graph states both."""
    prompt = new = None
    for node in spec.nodes.values():
        config = node.config if isinstance(node.config, dict) else {}
        if isinstance(config.get("max_prompt_tokens"), int):
            prompt = max(prompt or 0, config["max_prompt_tokens"])
        if isinstance(config.get("max_new_tokens"), int):
            new = max(new or 0, config["max_new_tokens"])
    return prompt + new if prompt is not None and new is not None else None


def check(spec: GraphSpec, classes: dict[str, type]) -> list[Finding]:
    out = []
    caps = _caps(spec)
    for name, node in spec.nodes.items():
        config = node.config if isinstance(node.config, dict) else {}
        budget = token_budget(config, classes.get(name))
        if budget is None:
            continue
        context = model_context(config, classes.get(name))
        bounds = [b for b in (context, caps) if b is not None]
        if not bounds:
            continue
        longest = min(bounds)
        if budget < longest:
            why = (f"the model takes {context} tokens" if longest == context else
                   f"prompts of up to max_prompt_tokens plus max_new_tokens make {caps} tokens")
            key = "train.max_tokens_per_microbatch" if "max_tokens_per_microbatch" not in config else \
                "max_tokens_per_microbatch"
            out.append(Finding("token-budget", name,
                               f"node `{name}` packs at most {budget} tokens per micro-batch ({key}), but a "
                               f"sequence may have {longest} tokens ({why}); such a sequence stops the node. "
                               f"Fix: set {key}: {longest} or more, or lower the caps (max_prompt_tokens, "
                               "max_new_tokens, the model's context)"))
    return out
