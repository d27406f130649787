"""Hugging Face causal LMs behind the same interface as the built-in model (optional extra).

    pip install 'flowrl[hf]'
    model: {type: hf, path: /models/Qwen2.5-0.5B-Instruct, dtype: bfloat16}

A policy or reference is ``AutoModelForCausalLM``; a critic is the base ``AutoModel`` (no LM head)
plus a zero-initialised linear value head on the last hidden state. Only local folders are read
(``local_files_only``): a node never downloads. transformers is imported when a model is built,
never when flowrl is imported, so everything else works without it.

Padding goes to transformers as it expects it: a 2-D ``attention_mask`` (1 on real tokens) plus
``position_ids`` counting the real tokens, so a left-padded prompt decodes as it does alone and a
pad is never attended to. ``forward_packed`` right-pads the sequences of a micro-batch into one
batch (right pads are never seen by real tokens under causal attention) and gathers the real
positions back. Only 2-D masks are passed, the form every attention implementation of transformers
takes (eager and sdpa are tested here; a 4-D block mask would not reach flash attention).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flowrl.models.base import CausalLM, default_positions
from flowrl.models.spec import HFModelSpec
from flowrl.transport.ragged import Ragged

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "model type `hf` needs the transformers package: pip install 'flowrl[hf]' "
            "(or pip install transformers)"
        ) from None
    return transformers


def _load_kwargs(spec: HFModelSpec, transformers: Any) -> dict[str, Any]:
    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    dtype_key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"  # renamed in 4.56
    kwargs: dict[str, Any] = {
        dtype_key: _DTYPES[spec.dtype],
        "trust_remote_code": spec.trust_remote_code,
        "local_files_only": True,
    }
    if spec.attn_implementation is not None:
        kwargs["attn_implementation"] = spec.attn_implementation
    return kwargs


class HFCausalLM(CausalLM):
    """Adapter: ``forward`` / ``new_cache`` / ``forward_cached`` over a transformers model."""

    def __init__(self, backbone: nn.Module, *, value_head: bool, seed: int = 0) -> None:
        super().__init__()
        self.backbone = backbone
        self.has_value_head = value_head
        config = backbone.config
        self.vocab_size = int(config.vocab_size)
        # transformers 5 renamed the cache argument; accept either.
        params = inspect.signature(backbone.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        if value_head:
            dtype = next(backbone.parameters()).dtype
            self.value_head = nn.Linear(int(config.hidden_size), 1, dtype=dtype)
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, L, V]`` or values ``[B, L]``; pads (``attention_mask`` False) are never
        attended to, and positions default to the count of real tokens before each one."""
        kwargs: dict[str, Any] = {"input_ids": tokens, "use_cache": False}
        if attention_mask is not None:
            attention_mask = attention_mask.to(device=tokens.device, dtype=torch.long)
            kwargs["attention_mask"] = attention_mask
            if position_ids is None:
                position_ids = default_positions(attention_mask)
        if position_ids is not None:
            kwargs["position_ids"] = position_ids.to(tokens.device)
        if self.has_value_head:
            hidden = self.backbone(**kwargs).last_hidden_state
            return self.value_head(hidden).squeeze(-1)  # [B, L]
        return self.backbone(**kwargs).logits  # [B, L, V]

    def forward_packed(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Outputs ``[N, V]`` (values ``[N]``) of packed sequences: one right-padded batch with an
        attention mask and positions from 0 per row; the real positions are gathered back."""
        bounds = cu_seqlens.to(torch.int64).cpu()
        lens = bounds[1:] - bounds[:-1]
        keep = torch.nonzero(lens > 0).flatten()
        if len(keep) == 0:
            return self.forward(tokens.new_zeros(1, 1))[0, :0]
        seqs = Ragged(tokens, bounds.to(tokens.device), check=False).select(keep.numpy())
        padded, mask = seqs.to_padded(0), seqs.mask()
        positions = torch.arange(padded.shape[1], device=tokens.device).expand(padded.shape[0], -1)
        return self.forward(padded, attention_mask=mask, position_ids=positions)[mask]

    def new_cache(self, batch: int, max_len: int) -> dict[str, Any]:
        """The library creates its own cache on the first call; we keep whatever it returns, the
        2-D mask of the slots so far (once a pad appears) and each row's next position."""
        return {"past": None, "length": 0, "mask": None, "padded": False, "next_pos": None}

    def forward_cached(self, tokens: torch.Tensor, cache: dict[str, Any], start: int,
                       attention_mask: torch.Tensor | None = None,
                       position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, S, V]`` of the tokens in slots ``start..start+S-1``; extends ``cache``.
        With pads in the cache, transformers gets the whole slot mask and real-token positions."""
        if self.has_value_head:
            raise TypeError("forward_cached samples tokens; a value-head model (critic) has no logits")
        if start != cache["length"]:
            raise ValueError(f"cache holds {cache['length']} positions but start={start}; feed tokens in order")
        b, s = tokens.shape
        device = tokens.device
        if attention_mask is None:
            new = torch.ones(b, s, dtype=torch.long, device=device)
            steps = torch.arange(s, device=device)[None]
        else:
            new = attention_mask.to(device=device, dtype=torch.long)
            steps = default_positions(new)
            cache["padded"] = cache["padded"] or not bool(new.all())
        next_pos = cache["next_pos"] if cache["next_pos"] is not None else torch.zeros(b, dtype=torch.long,
                                                                                      device=device)
        cache["mask"] = new if cache["mask"] is None else torch.cat([cache["mask"], new], dim=1)
        kwargs: dict[str, Any] = {"input_ids": tokens, "use_cache": True}
        if cache["padded"]:
            kwargs["attention_mask"] = cache["mask"]
        if cache["padded"] or position_ids is not None:
            kwargs["position_ids"] = (next_pos[:, None] + steps) if position_ids is None else position_ids.to(device)
        if cache["past"] is not None:
            kwargs[self._cache_arg] = cache["past"]
        out = self.backbone(**kwargs)
        past = getattr(out, "cache", None)
        cache["past"] = past if past is not None else out.past_key_values
        cache["next_pos"] = next_pos + new.sum(dim=1)
        cache["length"] = start + s
        return out.logits


def load_hf_model(spec: HFModelSpec, *, value_head: bool = False, seed: int = 0) -> HFCausalLM:
    """Load ``spec.path`` as a policy (causal LM) or, with ``value_head``, a critic."""
    if not (Path(spec.path) / "config.json").is_file():
        raise FileNotFoundError(
            f"model.path={spec.path!r} has no config.json; point it at a local folder saved with "
            "save_pretrained (flowrl never downloads models)"
        )
    transformers = _transformers()
    auto = transformers.AutoModel if value_head else transformers.AutoModelForCausalLM
    backbone = auto.from_pretrained(spec.path, **_load_kwargs(spec, transformers))
    own_memory(backbone)
    model = HFCausalLM(backbone, value_head=value_head, seed=seed)
    model.source_path = str(spec.path)  # which base a LoRA checkpoint belongs to (flowrl.models.lora)
    return model


def own_memory(module: nn.Module) -> None:
    """Give every tensor still mapped from the checkpoint file (safetensors loads by mmap) memory of
    its own: a mapped storage cannot be resized, so it could neither be released between turns
    (flowrl.rl.offload) nor outlive a rewrite of the file. Tied weights stay tied (one Parameter)."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if not t.untyped_storage().resizable():
                t.data = t.data.clone()


def load_tokenizer(path: str, *, trust_remote_code: bool = False) -> Any:
    """The tokenizer of a local model folder (its chat template included); never downloads."""
    if not (Path(path) / "tokenizer_config.json").is_file():
        raise FileNotFoundError(
            f"{path!r} has no tokenizer_config.json; save the tokenizer next to the model "
            "(tokenizer.save_pretrained(path)); examples/hf_tiny/make_model.py writes one for the digit tasks"
        )
    return _transformers().AutoTokenizer.from_pretrained(path, local_files_only=True,
                                                         trust_remote_code=trust_remote_code)


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` rendered with the folder's chat template, ready to generate after."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat_template; add one to tokenizer_config.json or encode prompts "
                         "directly")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def check_task_vocabulary(tokenizer: Any) -> None:
    """The built-in tasks speak token ids, not text: a tokenizer used with them must map each
    character of ``flowrl.tasks.vocab`` to that character's id (EOS included)."""
    from flowrl.tasks.vocab import _SYMBOLS, EOS

    ids = tokenizer.convert_tokens_to_ids(list(_SYMBOLS))
    wrong = [(ch, i, got) for i, (ch, got) in enumerate(zip(_SYMBOLS, ids)) if got != i]
    if wrong or tokenizer.eos_token_id != EOS:
        raise ValueError(
            f"tokenizer does not speak the task vocabulary: (char, task id, tokenizer id) {wrong[:4]}, "
            f"eos_token_id={tokenizer.eos_token_id} (task EOS {EOS}); write a matching one with "
            "examples/hf_tiny/make_model.py"
        )
