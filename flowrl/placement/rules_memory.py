"""Does every GPU hold what is planned on it: `memory-exceeded` (error), `memory-headroom` (warning)
and `model-size-unknown` (warning).

    flowrl check graph.yaml --inventory examples/inventories/a100x8-nvlink.yaml

Where a node's model comes from, first that applies:
1. `model_size: 72B` on the node (for a model folder that is not on this machine);
2. its config's `model:`: `{type: tiny, ...}` (the built-in transformer, sized exactly) or
   `{type: hf, path: ...}` whose `config.json` is read with `json` (no transformers import); when
   the folder is not on this machine, the size its name states (`Qwen2.5-0.5B`, `SmolLM2-135M`),
   said so in the messages; else a `model-size-unknown` warning: never a silent pass;
3. the node class's default model, when its `Config` has a `model` field.
A node with none of these (a task reward, a helper) needs no GPU memory here. A rollout whose
config reserves a share of the card (`gpu_memory_utilization`, a vLLM engine's default 0.5)
needs that share. The numbers are those of flowrl/placement/memory.py; each device sums every
process planned on it, except colocated nodes that take turns (flowrl/placement/turns.py). Every
set of nodes sharing a GPU is checked; a GPU another job uses is judged by `device-busy`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from flowrl.graph.spec import GraphSpec, NodeSpec
from flowrl.placement.devices import Inventory
from flowrl.placement.findings import Finding, ids_text
from flowrl.placement.rules_tokens import token_budget
from flowrl.placement.memory import (ACTIVATION_TOKENS, HEADROOM, TRAINERS, ModelShape, Need, gib, hf_shape, lora_params,
                                     min_ranks, node_need, tiny_params)
from flowrl.placement.requests import Request, colocation_groups
from flowrl.placement.turns import DeviceLoad, Key

SIZE_IN_NAME = re.compile(r"(?<![A-Za-z0-9.])(\d+(?:\.\d+)?)\s*([MmBb])(?![A-Za-z0-9])")
"""A parameter count in a model folder's name at a word boundary: `135M`, `0.5B`, `8B`, `70b`."""
VLLM_DEFAULT_SHARE = 0.5
"""`gpu_memory_utilization` of a vLLM engine that does not set it (flowrl/engines/spec.py)."""


def size_from_name(path: str) -> tuple[int, str] | None:
    """(parameters, folder name) from the first folder name, last first, stating a size."""
    for part in reversed(Path(path).parts):
        m = SIZE_IN_NAME.search(part)
        if m:
            return int(float(m.group(1)) * (1e6 if m.group(2) in "Mm" else 1e9)), part
    return None


def _model(node: NodeSpec, cls: type | None):
    model = node.config.get("model") if isinstance(node.config, dict) else None
    if model is None and "model" in getattr(getattr(cls, "Config", None), "model_fields", {}):
        model = {"type": "tiny"}
    return model


def sizing(node: NodeSpec, cls: type | None) -> tuple[ModelShape | None, str | None]:
    """(the node's model size or None, why a model it has could not be sized or None)."""
    model = _model(node, cls)
    shape, why = None, None
    if isinstance(model, dict):
        try:
            shape, why = _from_model(model)
        except (ValueError, TypeError, OSError) as e:
            why = f"its model config could not be read ({str(e)[:200]})"
    if node.model_size is not None:
        base = shape or ModelShape(0)
        return ModelShape(int(node.model_size), base.hidden, base.layers, base.vocab, "`model_size`", base.linear), None
    return shape, why


def model_shape(node: NodeSpec, cls: type | None) -> ModelShape | None:
    """The node's model size (see the module docstring), or None when it holds no model we can size."""
    return sizing(node, cls)[0]


def _from_model(model: dict) -> tuple[ModelShape | None, str | None]:
    if model.get("type", "tiny") == "tiny":
        from flowrl.models.spec import TinyLMSpec  # pydantic only, no torch

        s = TinyLMSpec(**{k: v for k, v in model.items()})
        params = tiny_params(s.d_model, s.n_layers, s.vocab_size, s.mlp_ratio, s.max_seq_len, s.tie_embeddings, s.positions)
        return ModelShape(params, s.d_model, s.n_layers, s.vocab_size, "the built-in tiny model"), None
    if model.get("type") == "hf" and isinstance(model.get("path"), str):
        path = Path(model["path"]) / "config.json"
        if not path.is_file() or path.stat().st_size > 1 << 20:
            named = size_from_name(model["path"])
            if named:
                return ModelShape(named[0], source=f"the folder name `{named[1]}` ({path} is not on this "
                                  "machine; set `model_size:` if the name is wrong)"), None
            return None, f"{path} is not on this machine and the folder name states no size"
        config = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            return None, f"{path} does not hold a JSON object"
        shape = hf_shape(config)
        return ModelShape(shape.params, shape.hidden, shape.layers, shape.vocab, f"{path}", shape.linear), None
    return None, None


def _share(node: NodeSpec) -> float | None:
    """A `gpu_memory_utilization` in the node's config (or one level down, e.g. `engine:`); a vLLM
    engine without one reserves its default share."""
    config = node.config if isinstance(node.config, dict) else {}
    for where in (config, *(v for v in config.values() if isinstance(v, dict))):
        v = where.get("gpu_memory_utilization")
        if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1:
            return float(v)
    engine = config.get("engine")
    if isinstance(engine, dict) and engine.get("type") == "vllm" and not engine.get("kv_cache_memory_bytes"):
        return VLLM_DEFAULT_SHARE
    return None


def _lora(node: NodeSpec, shape: ModelShape | None) -> int | None:
    """Adapter parameters when the node trains LoRA adapters (`train.lora` in its config), else None."""
    config = node.config if isinstance(node.config, dict) else {}
    lora = config.get("train", {}).get("lora") if isinstance(config.get("train"), dict) else None
    if not isinstance(lora, dict) or shape is None:
        return None
    return lora_params(shape, lora)


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
        need, shape = _need(node, classes.get(name), req.role, req.size, card)
        for fused, f in node.fused.items():  # fused nodes' models (fuse_into) share the host's GPUs
            cls = _kind(f.kind)
            if cls is not None:
                for k, b in _need(f, cls, getattr(cls, "role", None), req.size, card)[0].parts.items():
                    need.parts[f"{fused} {k}"] = b
        if need.total:
            out[name] = (need, shape)
    return out


def _need(node: NodeSpec, cls: type | None, role: str | None, ranks: int, card: int | None
          ) -> tuple[Need, ModelShape | None]:
    """What one rank of `node` needs on a GPU of `card` bytes, and the model it was sized from."""
    shape = model_shape(node, cls)
    budget = token_budget(node.config if isinstance(node.config, dict) else {}, cls)
    return node_need(shape, role=role, dtype=_dtype(node), ranks=ranks, card_bytes=card, reserve_share=_share(node),
                     tokens=budget or ACTIVATION_TOKENS, trainable=_lora(node, shape)), shape


def _kind(kind: str) -> type | None:
    from flowrl.graph.kinds import KindError, resolve_kind

    try:
        return resolve_kind(kind)
    except KindError:  # the graph check names it
        return None


def unsized(spec: GraphSpec, inv: Inventory, reqs: dict[str, Request], classes: dict[str, type]) -> list[Finding]:
    """`model-size-unknown`: a node on GPUs with a model whose size cannot be learned here."""
    out = []
    if inv.device_type != "cuda":
        return out
    for name, req in reqs.items():
        if not req.placed or not req.size or _share(spec.nodes[name]) is not None:
            continue
        shape, why = sizing(spec.nodes[name], classes.get(name))
        if shape is None and why:
            devs = sorted({d.id for g in req.placed for d in g})
            out.append(Finding("model-size-unknown", name,
                               f"node `{name}` holds a model whose size flowrl check cannot learn: {why}; its GPU "
                               f"memory (GPU(s) {ids_text(devs)}) is not checked. Fix: add its parameter count to the "
                               f"node, e.g. `model_size: 7B` on `{name}`, or run flowrl check where the model folder is",
                               tuple(devs), req.placed[0][0].host))
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


def _turns_fix(spec: GraphSpec, load: DeviceLoad, cap: int) -> str | None:
    """`take_turns: true` when the nodes on the GPU are one colocation group whose larger turn fits."""
    groups = colocation_groups(spec)
    names = list(load.nodes)
    if load.turns or len(names) < 2 or len({groups[n] for n in names}) != 1:
        return None
    trial = DeviceLoad(load.device, dict(load.nodes), dict(load.procs), [names])
    if trial.total + load.foreign > (1 - HEADROOM) * cap:
        return None
    return (f"declare `take_turns: true` on `{names[0]}` (generate, then train: the larger turn, "
            f"{trial.text(foreign=False)} = {gib(trial.total)}, fits)")


def _over(loads: dict[Key, DeviceLoad]) -> dict[str, dict[frozenset, list[DeviceLoad]]]:
    """Largest node -> each set of nodes sharing GPUs with it -> those GPUs, above HEADROOM."""
    out: dict[str, dict[frozenset, list[DeviceLoad]]] = {}
    for load in loads.values():
        cap = load.device.memory_bytes
        if not cap or load.device.busy or load.total + load.foreign <= (1 - HEADROOM) * cap:
            continue  # a GPU another job uses is judged by `device-busy` (rules_sharing.py)
        top = max(sorted(load.nodes), key=lambda n: load.nodes[n])
        out.setdefault(top, {}).setdefault(frozenset(load.nodes), []).append(load)
    return out


def check(spec: GraphSpec, inv: Inventory, reqs: dict[str, Request], node_needs: dict,
          loads: dict[Key, DeviceLoad]) -> list[Finding]:
    """Every set of nodes sharing a GPU (or a node alone) that holds too much there; one finding per
    node holding the most, naming each such set and its GPUs."""
    out: list[Finding] = []
    for name, sets in _over(loads).items():
        need, shape = node_needs[name]
        req, node = reqs[name], spec.nodes[name]
        held, fixes, devices, others, ratio = [], [], [], [], 0.0
        for over in sets.values():
            worst = max(over, key=lambda x: (x.total + x.foreign) / x.device.memory_bytes)
            total, cap = worst.total + worst.foreign, worst.device.memory_bytes
            ratio = max(ratio, total / cap)
            partners = next((g for g in worst.turns if name in g), [name])
            others += [o for o in worst.nodes if o not in partners and o not in others]  # turn partners free nothing
            where = f" on {worst.device.host}" if inv.multi_host else ""
            text = f"{worst.text()} = {gib(total)}" if len(worst.nodes) > 1 or worst.foreign else gib(total)
            held.append(f"GPU(s) {ids_text([x.device.id for x in over])}{where} hold {text} of {gib(cap)} each")
            fixes.append(_turns_fix(spec, worst, cap))
            devices += [x.device.id for x in over]
        cap = min(x.device.memory_bytes for o in sets.values() for x in o)
        source = f"{shape.params / 1e9:,.2f}B parameters from {shape.source}; " if shape and shape.params else ""
        ranks = f", sharded over {req.size} ranks" if req.size > 1 and "weights" in need.parts else ""
        what = f"node `{name}` needs about {gib(need.total)} per GPU ({source}{need.text()}{ranks}); {'; '.join(held)}"
        fix = "; ".join(dict.fromkeys(x for x in (*fixes, _fix(name, node, req, shape, cap, others)) if x))
        host = next(iter(sets.values()))[0].device.host
        if ratio > 1:
            out.append(Finding("memory-exceeded", name, f"{what}; it would run out of memory. Fix: {fix}",
                               tuple(sorted(devices)), host))
        else:
            out.append(Finding("memory-headroom", name,
                               f"{what}: {ratio:.0%} planned, less than {HEADROOM:.0%} left for fragmentation "
                               f"and peaks (long sequences, large batches). Fix: {fix}", tuple(sorted(devices)), host))
    return out


def fused(spec: GraphSpec, inv: Inventory) -> list[Finding]:
    """`fused` (info): which nodes run inside which host's process (`fuse_into`,
    flowrl.graph.fusion). A fused node's model counts on its host's GPUs (`needs`)."""
    out = []
    for host, node in spec.nodes.items():
        if node.fused:
            names = ", ".join(node.fused)
            out.append(Finding("fused", host, f"{names} {'runs' if len(node.fused) == 1 else 'run'} inside `{host}`'s "
                               "process, as part of each of its calls (fuse_into): no process, channel or message of "
                               "its own" + ("; a model it holds counts on the host's GPUs" if inv.device_type == "cuda"
                                            else "")))
    return out
