"""Typed model configs, keyed on ``type`` (no torch import: the graph loader uses them).

In a graph file::

    model: {type: tiny, d_model: 128, n_layers: 2, n_heads: 4}
    model: {type: hf, path: /models/qwen2.5-0.5b, dtype: bfloat16}

:func:`parse_model_spec` validates such a mapping; unknown keys are rejected with the valid ones.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator


class TinyLMSpec(BaseModel):
    """The built-in decoder-only transformer (pre-norm, causal, KV-cache sampling).

    Small enough to train from scratch with RL on a CPU core in under a minute on the built-in
    tasks, and the same code path the Hugging Face adapter follows.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["tiny"] = "tiny"
    vocab_size: int = Field(18, ge=2)
    """Token ids the model reads and writes; 18 = ``flowrl.tasks.VOCAB_SIZE``."""
    d_model: int = Field(128, ge=8)
    """Width of the residual stream."""
    n_layers: int = Field(2, ge=1)
    """Transformer blocks."""
    n_heads: int = Field(4, ge=1)
    """Attention heads per block; must divide ``d_model``."""
    mlp_ratio: int = Field(4, ge=1)
    """Hidden width of each MLP, as a multiple of ``d_model``."""
    max_seq_len: int = Field(64, ge=2)
    """Longest prompt + response the model accepts (size of the learned position table / KV cache)."""
    positions: Literal["learned", "rope"] = "learned"
    """Learned absolute position embeddings, or rotary embeddings applied to queries and keys.

    Learned positions are what the presets were tuned with: digit reversal maps absolute positions,
    and with the PPO preset a rotary model was still at reward 0.81 after 400 steps where learned
    positions reach 0.9 in about 60."""
    tie_embeddings: bool = False
    """Share the token embedding with the output projection."""
    init_std: float = Field(0.02, gt=0)
    """Std of the normal initialisation; output projections of each block are scaled by 1/sqrt(2 n_layers)."""

    @model_validator(mode="after")
    def _heads_divide_width(self) -> "TinyLMSpec":
        if self.d_model % self.n_heads:
            raise ValueError(
                f"n_heads={self.n_heads} must divide d_model={self.d_model}; "
                f"pick n_heads from {[h for h in range(1, self.d_model + 1) if self.d_model % h == 0][:8]}"
            )
        if self.positions == "rope" and (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"rotary positions need an even head size, got d_model/n_heads = "
                f"{self.d_model}/{self.n_heads} = {self.d_model // self.n_heads}"
            )
        return self


class HFModelSpec(BaseModel):
    """A Hugging Face causal LM loaded from a local folder (needs ``pip install flowrl[hf]``).

    As a critic (``value_head=True``) the base model is loaded without its LM head and a linear
    value head is added on the last hidden state.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["hf"] = "hf"
    path: str
    """Local folder with ``config.json`` and weights (nothing is downloaded)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype after loading."""
    trust_remote_code: bool = False
    """Allow the folder's own modelling code to run (only for checkpoints you trust)."""
    attn_implementation: str | None = None
    """Passed to ``from_pretrained`` (``"sdpa"``, ``"eager"``, ``"flash_attention_2"``); None = library default."""


ModelSpec = Annotated[Union[TinyLMSpec, HFModelSpec], Field(discriminator="type")]
"""Any model config; ``type`` selects the class."""

MODEL_TYPES = ("tiny", "hf")

_ADAPTER: TypeAdapter[Any] = TypeAdapter(ModelSpec)


def parse_model_spec(value: Any) -> TinyLMSpec | HFModelSpec:
    """Validate a mapping (or pass a spec through); errors name the bad key and the valid choices."""
    if isinstance(value, (TinyLMSpec, HFModelSpec)):
        return value
    if isinstance(value, dict) and value.get("type") not in MODEL_TYPES:
        raise ValueError(
            f"unknown model type {value.get('type')!r}; choose one of {', '.join(MODEL_TYPES)} "
            "(for example `model: {type: tiny, d_model: 128}`)"
        )
    try:
        return _ADAPTER.validate_python(value)
    except ValidationError as exc:
        raise ValueError(f"invalid model config {value!r}: {exc}") from None
