"""How much GPU memory a node needs per device: pure functions on known numbers.

    params = hf_params(json.load(open("Qwen2.5-72B/config.json")))      # 72.7e9
    need = node_need(params, role="actor", dtype="bfloat16", ranks=2, card_bytes=40 * GIB, ...)
    need.total / GIB, need.parts                                      # 1,089 GiB: weights, grads, Adam, ...

The model (what the field's rules of thumb say, e.g. ZeRO's paper and verl's sizing guide):
- **trainers** (actor, critic) with Adam in mixed precision hold 16 bytes per parameter: weights
  and gradients in the compute dtype (2 + 2) plus an fp32 master copy and two fp32 moments
  (4 + 4 + 4); in float32, weights 4 + gradients 4 + moments 8 = 16 as well. FSDP (and tensor
  parallelism) shard all of it over the replica's ranks;
  with LoRA (`train.lora`) the base weights are frozen (weights only) and gradients and Adam
  state are the adapters' (r x (in + out) per targeted linear layer per block);
- **forward-only** nodes (reference, reward model, a rollout without an engine) hold the weights in
  their dtype, sharded over their ranks;
- a **rollout engine** that reserves a share of the card (`gpu_memory_utilization: 0.5`, vLLM style)
  takes that share, whatever its model;
- **activations**: per rank, one micro-batch of the node's token budget (`max_tokens_per_microbatch`:
  trainers pack sequences into micro-batches of at most that many tokens; `ACTIVATION_TOKENS` for a
  node without one) with activation checkpointing: a hidden state per layer in the compute dtype for trainers, plus fp32 logits
  (tokens x vocab) for anything that computes log-probabilities;
- **overhead**: the CUDA context and allocator reserve, `CONTEXT_BYTES` per process.
A device's need is the sum over the processes placed on it (colocated nodes add up), except
colocated nodes that take turns: their larger turn (flowrl/placement/turns.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GIB = 1 << 30
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
TRAIN_BYTES_PER_PARAM = 16
"""Weights + gradients + fp32 Adam master and two moments, per parameter (mixed precision or fp32)."""
CONTEXT_BYTES = 1 * GIB
"""CUDA context, cuBLAS/NCCL workspaces and the allocator's reserve, per process."""
ACTIVATION_TOKENS = 4096
"""Tokens of one micro-batch per rank that the activation estimate assumes for a node without a budget."""
HEADROOM = 0.10
"""A device planned above 90% of its memory leaves too little for fragmentation and peaks."""
TRAINERS = ("actor", "critic")


@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs to know about a model."""

    params: int
    hidden: int | None = None
    layers: int | None = None
    vocab: int | None = None
    source: str = ""
    """Where the numbers came from, for messages: `config.json at ...`, `model_size: 72B`."""
    linear: tuple[tuple[str, int, int], ...] = ()
    """(name, in, out) of each linear layer of one block (`q_proj`, ..., `down_proj`), for LoRA."""


@dataclass
class Need:
    """Bytes one process needs on its device, by part (for messages)."""

    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def text(self) -> str:
        return ", ".join(f"{name} {gib(b)}" for name, b in self.parts.items() if b)


def gib(n: float) -> str:
    return f"{n / GIB:,.1f} GiB"


def tiny_params(d_model: int, n_layers: int, vocab_size: int, mlp_ratio: int = 4, max_seq_len: int = 64,
                tie_embeddings: bool = False, positions: str = "learned") -> int:
    """Parameters of flowrl's built-in transformer (flowrl/models/tiny.py)."""
    embed = vocab_size * d_model + (max_seq_len * d_model if positions == "learned" else 0)
    # attention (qkv + proj) and MLP weights, their biases, two LayerNorms
    block = (4 + 2 * mlp_ratio) * d_model * d_model + (5 + mlp_ratio) * d_model + 4 * d_model
    head = 0 if tie_embeddings else vocab_size * d_model
    return embed + n_layers * block + 2 * d_model + head


def _get(config: dict, *names, default=None):
    for n in names:
        v = config.get(n)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
            return int(v)
    return default


def hf_shape(config: dict) -> ModelShape:
    """Parameters of a decoder-only Hugging Face model from its `config.json` (Llama, Qwen, Mistral,
    Mixtral-style MoE, GPT-2 names). Raises ValueError when the sizes are not there."""
    text = config.get("text_config")
    if isinstance(text, dict) and "hidden_size" not in config:
        config = text  # multimodal wrappers keep the language model's sizes here
    h = _get(config, "hidden_size", "n_embd", "d_model")
    layers = _get(config, "num_hidden_layers", "n_layer", "num_layers")
    vocab = _get(config, "vocab_size")
    if not (h and layers and vocab):
        raise ValueError("config.json lacks hidden_size / num_hidden_layers / vocab_size")
    inter = _get(config, "intermediate_size", "n_inner", "ffn_dim", default=4 * h)
    heads = _get(config, "num_attention_heads", "n_head", default=max(1, h // 128))
    kv = _get(config, "num_key_value_heads", default=heads)
    head_dim = _get(config, "head_dim", default=h // heads)
    experts = _get(config, "num_local_experts", "num_experts", "n_routed_experts", default=1)
    moe_inter = _get(config, "moe_intermediate_size", default=inter)
    mlp_mats = 3 if config.get("hidden_act", "silu") in ("silu", "swiglu", "gelu_pytorch_tanh") or "llama" in str(
        config.get("model_type", "")) else 2
    attn = h * heads * head_dim + 2 * h * kv * head_dim + heads * head_dim * h
    mlp = mlp_mats * h * (moe_inter if experts > 1 else inter) * experts + (h * experts if experts > 1 else 0)
    embed = vocab * h
    head = 0 if config.get("tie_word_embeddings", False) else vocab * h
    params = embed + layers * (attn + mlp + 2 * h) + h + head
    width = moe_inter if experts > 1 else inter
    linear = (("q_proj", h, heads * head_dim), ("k_proj", h, kv * head_dim), ("v_proj", h, kv * head_dim),
              ("o_proj", heads * head_dim, h), ("gate_proj", h, width), ("up_proj", h, width), ("down_proj", width, h))
    return ModelShape(params, h, layers, vocab, linear=linear if mlp_mats == 3 else linear[:4] + linear[5:])


def lora_params(shape: ModelShape, lora: dict) -> int | None:
    """Trainable parameters of LoRA adapters: r x (in + out) per targeted linear layer per block
    (`train.lora: {r, target_modules}`; all linear layers when none or `all-linear` is given). A
    target the shape does not know, or a shape without its layers (a size from `model_size`), is
    taken as hidden x hidden. None when the shape has no hidden size or layer count."""
    if not (shape.hidden and shape.layers):
        return None
    r = lora.get("r", 8)
    r = r if isinstance(r, int) and not isinstance(r, bool) and r > 0 else 8
    known = {name: (i, o) for name, i, o in shape.linear}
    targets = lora.get("target_modules")
    if not targets or targets == "all-linear":
        targets = list(known) or ["q_proj", "k_proj", "v_proj", "o_proj"]
    elif isinstance(targets, str):
        targets = [targets]
    dims = [known.get(str(t).rsplit(".", 1)[-1], (shape.hidden, shape.hidden)) for t in targets]
    return shape.layers * sum(r * (i + o) for i, o in dims)


def node_need(shape: ModelShape | None, *, role: str | None, dtype: str, ranks: int, card_bytes: int | None,
              reserve_share: float | None = None, tokens: int = ACTIVATION_TOKENS, trainable: int | None = None) -> Need:
    """Bytes one rank of a node needs on its device (see the module docstring for the model).
    `trainable`: a trainer's trained parameters when only adapters train (LoRA): the base weights
    are frozen (weights only), gradients and Adam state are the adapters'."""
    need = Need()
    if reserve_share is not None and card_bytes:
        need.parts["engine reservation"] = int(reserve_share * card_bytes)
        return need
    if shape is None:
        return need
    ranks = max(1, ranks)
    width = BYTES.get(dtype, 4)
    if role in TRAINERS and trainable is not None:
        need.parts["weights (frozen base + adapters)"] = (shape.params + trainable) * width // ranks
        need.parts["adapter gradients"] = trainable * width // ranks
        need.parts["adapter Adam state"] = trainable * (TRAIN_BYTES_PER_PARAM - 2 * width) // ranks
    elif role in TRAINERS:
        need.parts["weights"] = shape.params * width // ranks
        need.parts["gradients"] = shape.params * width // ranks
        need.parts["Adam state (fp32 master + 2 moments)"] = shape.params * (TRAIN_BYTES_PER_PARAM - 2 * width) // ranks
    else:
        need.parts["weights"] = shape.params * width // ranks
    if shape.hidden and shape.layers:
        hidden = tokens * shape.hidden * shape.layers * width if role in TRAINERS else 0
        logits = tokens * (shape.vocab or 0) * 4
        need.parts["activations"] = hidden + logits
    need.parts["CUDA context"] = CONTEXT_BYTES
    return need


def min_ranks(shape: ModelShape, *, role: str | None, dtype: str, card_bytes: int,
              tokens: int = ACTIVATION_TOKENS) -> int | None:
    """Fewest ranks (of this card) over which the node's sharded state fits under 90% of the card."""
    fixed = node_need(shape, role=role, dtype=dtype, ranks=1, card_bytes=card_bytes, tokens=tokens)
    sharded = sum(v for k, v in fixed.parts.items() if k not in ("activations", "CUDA context"))
    room = (1 - HEADROOM) * card_bytes - fixed.parts.get("activations", 0) - CONTEXT_BYTES
    if room <= 0:
        return None
    return max(1, math.ceil(sharded / room))
