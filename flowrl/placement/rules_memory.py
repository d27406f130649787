"""Does every GPU hold what is planned on it: `memory-exceeded` (error) and `memory-headroom` (warning).

    flowrl check graph.yaml --inventory examples/inventories/a100x8-nvlink.yaml

Where a node's model comes from, first that applies:
1. `model_size: 72B` on the node (for a model folder that is not on this machine);
2. its config's `model:`: `{type: tiny, ...}` (the built-in transformer, sized exactly) or
   `{type: hf, path: ...}` whose `config.json` is read with `json` (no transformers import);
3. the node class's default model, when its `Config` has a `model` field.
A node with none of these (a task reward, a helper) needs no GPU memory here. A rollout whose
config reserves a share of the card (`gpu_memory_utilization`) needs that share. The numbers are
those of flowrl/placement/memory.py; each device sums every process planned on it.
"""

from __future__ import annotations

import json
from pathlib import Path

from flowrl.graph.spec import GraphSpec, NodeSpec
from flowrl.placement.devices import Inventory
from flowrl.placement.findings import Finding, ids_text
from flowrl.placement.rules_tokens import token_budget
from flowrl.placement.memory import ACTIVATION_TOKENS, HEADROOM, TRAINERS, ModelShape, Need, gib, hf_shape, min_ranks, node_need, tiny_params
from flowrl.placement.requests import Request

Key = tuple[str, int]


def model_shape(node: NodeSpec, cls: type | None) -> ModelShape | None:
    """The node's model size (see the module docstring), or None when it holds no model we can size."""
    model = node.config.get("model") if isinstance(node.config, dict) else None
    if model is None and "model" in getattr(getattr(cls, "Config", None), "model_fields", {}):
        model = {"type": "tiny"}
    shape = None
    if isinstance(model, dict):
        try:
            shape = _from_model(model)
        except (ValueError, TypeError, OSError):
            shape = None  # the node's own config check reports a bad model; here it is just unsized
    if node.model_size is not None:
        base = shape or ModelShape(0)
        return ModelShape(int(node.model_size), base.hidden, base.layers, base.vocab, "`model_size`")
    return shape


def _from_model(model: dict) -> ModelShape | None:
    if model.get("type", "tiny") == "tiny":
        from flowrl.models.spec import TinyLMSpec  # pydantic only, no torch

        s = TinyLMSpec(**{k: v for k, v in model.items()})
        params = tiny_params(s.d_model, s.n_layers, s.vocab_size, s.mlp_ratio, s.max_seq_len, s.tie_embeddings, s.positions)
        return ModelShape(params, s.d_model, s.n_layers, s.vocab_size, "the built-in tiny model")
    if model.get("type") == "hf" and isinstance(model.get("path"), str):
        path = Path(model["path"]) / "config.json"
        if not path.is_file() or path.stat().st_size > 1 << 20:
            return None
        config = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            return None
        shape = hf_shape(config)
        return ModelShape(shape.params, shape.hidden, shape.layers, shape.vocab, f"{path}")
    return None


def _share(node: NodeSpec) -> float | None:
    """A `gpu_memory_utilization` in the node's config (or one level down, e.g. `engine:`)."""
    config = node.config if isinstance(node.config, dict) else {}
    for where in (config, *(v for v in config.values() if isinstance(v, dict))):
        v = where.get("gpu_memory_utilization")
        if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1:
            return float(v)
    return None


def _dtype(node: NodeSpec) -> str:
    model = node.config.get("model") if isinstance(node.config, dict) else None
    if node.dtype == "float32" and isinstance(model, dict) and model.get("dtype") in ("bfloat16", "float16"):
        return model["dtype"]  # an HF model loaded in bf16 by its own config
    return node.dtype


def needs(spec: GraphSpec, inv: Inventory, reqs: dict[str, Request], classes: dict[str, type]
          ) -> dict[str, tuple[Need, ModelShape | None]]:
    """Per node: what one of its ranks needs on its GPU, and the model it was sized from."""
    out = {}
    if inv.device_type != "cuda":
        return out
    for name, req in reqs.items():
        if not req.placed or not req.size:
            continue
        node = spec.nodes[name]
        card = min((d.memory_bytes for g in req.placed for d in g if d.memory_bytes), default=None)
        shape = model_shape(node, classes.get(name))
        budget = token_budget(node.config if isinstance(node.config, dict) else {}, classes.get(name))
        need = node_need(shape, role=req.role, dtype=_dtype(node), ranks=req.size, card_bytes=card,
                         reserve_share=_share(node), tokens=budget or ACTIVATION_TOKENS)
        if need.total:
            out[name] = (need, shape)
    return out


def per_device(reqs: dict[str, Request], node_needs: dict) -> dict[Key, dict[str, int]]:
    """(host, id) -> {node: bytes its ranks there need}."""
    out: dict[Key, dict[str, int]] = {}
    for name, (need, _) in node_needs.items():
        for group in reqs[name].placed:
            for d in group:
                slot = out.setdefault((d.host, d.id), {})
                slot[name] = slot.get(name, 0) + need.total
    return out


def _fix(name: str, node: NodeSpec, req: Request, shape: ModelShape | None, card: int, others: list[str]) -> str:
    if _share(node) is not None:
        return (f"lower `gpu_memory_utilization` of `{name}`, or give the nodes it shares with "
                f"({', '.join(others) or 'none'}) other GPUs")
    ways = []
    if shape is not None and shape.params:
        n = min_ranks(shape, role=req.role, dtype=_dtype(node), card_bytes=card)
        if n and n > req.size:
            ways.append(f"shard it over at least {n} GPUs of {gib(card)} (`devices: {n}`)")
    if req.role in TRAINERS:
        ways.append("offload optimizer state and parameters to CPU (FSDP CPU offload)")
        ways.append("use a smaller micro-batch")
    elif _dtype(node) == "float32":
        ways.append("compute in bfloat16 (`dtype: bfloat16`, half the weights)")
    if others:
        ways.append(f"move {', '.join(f'`{o}`' for o in others)} to other GPUs")
    return "; ".join(ways) or "give it more or bigger GPUs"


def check(spec: GraphSpec, inv: Inventory, reqs: dict[str, Request], node_needs: dict) -> list[Finding]:
    out: list[Finding] = []
    by_device = per_device(reqs, node_needs)
    reported: set[frozenset] = set()
    order = sorted(node_needs, key=lambda n: -node_needs[n][0].total)
    for name in order:
        need, shape = node_needs[name]
        req, node = reqs[name], spec.nodes[name]
        worst = None
        for group in req.placed:
            for d in group:
                if not d.memory_bytes:
                    continue
                total = sum(by_device[(d.host, d.id)].values())
                if worst is None or total / d.memory_bytes > worst[0]:
                    worst = (total / d.memory_bytes, total, d)
        if worst is None or worst[0] <= 1 - HEADROOM:
            continue
        ratio, total, dev = worst
        key = (dev.host, dev.id)
        sharing = frozenset(by_device[key])
        if sharing in reported:
            continue  # one finding per set of nodes sharing the same GPUs
        reported.add(sharing)
        over = [d for g in req.placed for d in g
                if d.memory_bytes and sum(by_device[(d.host, d.id)].values()) > (1 - HEADROOM) * d.memory_bytes]
        others = [o for o in by_device[key] if o != name]
        with_others = "".join(f", plus `{o}` {gib(by_device[key][o])}" for o in others)
        source = f"{shape.params / 1e9:,.2f}B parameters from {shape.source}; " if shape and shape.params else ""
        ranks = f", sharded over {req.size} ranks" if req.size > 1 and "weights" in need.parts else ""
        what = (f"node `{name}` needs about {gib(need.total)} per GPU ({source}{need.text()}{ranks}){with_others}: "
                f"{gib(total)} on GPU(s) {ids_text([d.id for d in over])}{' on ' + dev.host if inv.multi_host else ''} "
                f"of {gib(dev.memory_bytes)} each")
        fix = _fix(name, node, req, shape, dev.memory_bytes, others)
        if ratio > 1:
            out.append(Finding("memory-exceeded", name, f"{what}; it would run out of memory. Fix: {fix}",
                               tuple(d.id for d in over), dev.host))
        else:
            out.append(Finding("memory-headroom", name,
                               f"{what}: {ratio:.0%} planned, less than {HEADROOM:.0%} left for fragmentation and peaks "
                               f"(long sequences, large batches). Fix: {fix}", tuple(d.id for d in over), dev.host))
    return out
