"""The built-in tiny transformer as a Hugging Face GPT-2 (learned positions) -- an exact mapping.

TinyLM with ``positions: learned`` is GPT-2's architecture: pre-norm blocks, LayerNorm (eps 1e-5)
with bias, one fused qkv projection laid out ``[q | k | v]`` with heads contiguous inside each,
exact-erf GELU MLP, final LayerNorm, learned absolute positions, an LM head without bias. GPT-2
stores its linear layers as ``Conv1D`` (``[in, out]``), so those weights are transposed; with
``activation_function: gelu`` (not GPT-2's default tanh approximation) and dropout 0 the logits
agree to float rounding. A rotary model (``positions: rope``) has no exact GPT-2 counterpart and is
refused with that reason.
"""

from __future__ import annotations

from typing import Any


def gpt2_config(spec: Any):
    from transformers import GPT2Config

    from flowrl.tasks.vocab import BOS, EOS, PAD

    if spec.positions != "learned":
        raise ValueError("export of a tiny model with `positions: rope` is not supported: it maps exactly onto no "
                         "transformers architecture without trust_remote_code; train with positions: learned")
    return GPT2Config(vocab_size=spec.vocab_size, n_positions=spec.max_seq_len, n_embd=spec.d_model,
                      n_layer=spec.n_layers, n_head=spec.n_heads, n_inner=spec.mlp_ratio * spec.d_model,
                      activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      layer_norm_epsilon=1e-5, tie_word_embeddings=spec.tie_embeddings,
                      bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)


def tiny_to_gpt2(state: dict[str, Any], spec: Any) -> dict[str, Any]:
    """A TinyLM policy state dict -> GPT2LMHeadModel's names and layouts."""
    out = {"transformer.wte.weight": state["tok_emb.weight"], "transformer.wpe.weight": state["pos_emb.weight"],
           "transformer.ln_f.weight": state["norm.weight"], "transformer.ln_f.bias": state["norm.bias"],
           "lm_head.weight": state["lm_head.weight"]}
    conv = {"attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "fc": "mlp.c_fc", "proj": "mlp.c_proj"}
    for i in range(spec.n_layers):
        src, dst = f"blocks.{i}.", f"transformer.h.{i}."
        for a, b in (("ln1", "ln_1"), ("ln2", "ln_2")):
            out[dst + b + ".weight"] = state[src + a + ".weight"]
            out[dst + b + ".bias"] = state[src + a + ".bias"]
        for a, b in conv.items():
            out[dst + b + ".weight"] = state[src + a + ".weight"].t().contiguous()
            out[dst + b + ".bias"] = state[src + a + ".bias"]
    return out
