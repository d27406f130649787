"""Text <-> token ids for a policy: the built-in model's character vocabulary, or a HF tokenizer.

    >>> tok = tokenizer_for({"type": "tiny", "vocab_size": TEXT_VOCAB_SIZE})
    >>> tok.encode("Q: 2+3?")            # BOS, then one id per character
    [12, 55, 33, 18, 2, 10, 3, 37]
    >>> tok.decode([5, 13])               # stops at EOS
    '5'

The built-in tiny model has no tokenizer of its own. Its 18-token task vocabulary
(:mod:`flowrl.tasks.vocab`) cannot spell words, so text datasets use :class:`CharTokenizer`: the
same 18 ids first (digits are their own value; ``+`` 10, ``=`` 11, BOS 12, EOS 13, PAD 14 -- the
ids the built-in rollout stops and pads with), then every other printable ASCII character and
newline, :data:`TEXT_VOCAB_SIZE` ids in all. A model reading text needs
``model: {type: tiny, vocab_size: 102}`` (or more). Hugging Face models (``type: hf``) use the
tokenizer saved in their folder (transformers, imported on first use; nothing is downloaded).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from flowrl.tasks.vocab import BOS, EOS, PAD, VOCAB_SIZE

_TASK_CHARS = {str(d): d for d in range(10)} | {"+": 10, "=": 11}
_OTHER = [chr(c) for c in range(32, 127) if chr(c) not in _TASK_CHARS] + ["\n"]
CHAR_IDS: dict[str, int] = {**_TASK_CHARS, **{ch: VOCAB_SIZE + i for i, ch in enumerate(_OTHER)}}
"""Character -> id of the text vocabulary."""
TEXT_VOCAB_SIZE = VOCAB_SIZE + len(_OTHER)
"""Ids the text vocabulary uses (102): set the tiny model's ``vocab_size`` to at least this."""


class TextTokenizer:
    """What the data and reward code needs from a tokenizer."""

    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int
    spec: dict[str, Any]
    """JSON-able description that rebuilds this tokenizer (:func:`tokenizer_for`); travels in batch meta."""

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids) -> str:
        """Text of ``ids`` up to (not including) the first EOS; special tokens left out."""
        raise NotImplementedError

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Ids of a chat, ready for the assistant's reply (the model's chat template)."""
        raise NotImplementedError


class CharTokenizer(TextTokenizer):
    """One id per character (see the module docstring); BOS first, no chat template."""

    vocab_size = TEXT_VOCAB_SIZE
    bos_id, eos_id, pad_id = BOS, EOS, PAD
    spec = {"type": "char"}
    _chars = {i: ch for ch, i in CHAR_IDS.items()}

    def encode(self, text: str) -> list[int]:
        try:
            return [BOS] + [CHAR_IDS[ch] for ch in text]
        except KeyError:
            bad = sorted({ch for ch in text if ch not in CHAR_IDS})
            raise ValueError(f"characters {bad} of {text[:60]!r} are not in the built-in model's text "
                             "vocabulary (printable ASCII and newline); clean the data, or use a Hugging "
                             "Face model and its tokenizer (model: {type: hf, path: ...})") from None

    def decode(self, ids) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == EOS:
                break
            ch = self._chars.get(i)
            if ch is not None:
                out.append(ch)
        return "".join(out)

    def chat(self, messages):
        raise ValueError("the built-in tiny model has no chat template; use `template:` (a format string) "
                         "instead of `chat_template: true`, or a Hugging Face model")


class HFTokenizer(TextTokenizer):
    """A tokenizer saved in a local Hugging Face model folder (``AutoTokenizer``, never downloads)."""

    def __init__(self, path: str, trust_remote_code: bool = False):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ImportError("a Hugging Face tokenizer needs transformers: pip install 'flowrl[hf]'") from None
        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
        self.vocab_size = len(self.tok)
        self.bos_id = self.tok.bos_token_id
        if self.tok.eos_token_id is None:
            raise ValueError(f"the tokenizer in {path} has no eos_token; set one in its tokenizer_config.json")
        self.eos_id = int(self.tok.eos_token_id)
        self.pad_id = int(self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id)
        self.spec = {"type": "hf", "path": str(path), "trust_remote_code": trust_remote_code}

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=True))

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self.tok.decode(ids, skip_special_tokens=True)

    def chat(self, messages):
        if not getattr(self.tok, "chat_template", None):
            raise ValueError(f"the tokenizer in {self.spec['path']} has no chat template; use `template:` instead")
        ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns an encoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]


def tokenizer_for(model: Any) -> TextTokenizer:
    """The tokenizer of a model spec (``{type: tiny, ...}`` or ``{type: hf, path}``) or of a
    tokenizer spec from batch meta (``{type: char}`` / ``{type: hf, path}``)."""
    if hasattr(model, "model_dump"):
        model = model.model_dump()
    kind = model.get("type")
    if kind in ("tiny", "char"):
        if kind == "tiny" and model.get("vocab_size", VOCAB_SIZE) < TEXT_VOCAB_SIZE:
            raise ValueError(
                f"model.vocab_size={model.get('vocab_size', VOCAB_SIZE)} cannot hold the text vocabulary of "
                f"{TEXT_VOCAB_SIZE} characters; set `vocab_size: {TEXT_VOCAB_SIZE}` in the model spec of every "
                "node (use a YAML anchor)")
        return CharTokenizer()
    if kind == "hf":
        return _hf(str(model["path"]), bool(model.get("trust_remote_code", False)))
    raise ValueError(f"no tokenizer for model type {kind!r}; use type tiny or hf")


@lru_cache(maxsize=4)
def _hf(path: str, trust_remote_code: bool) -> HFTokenizer:
    return HFTokenizer(path, trust_remote_code)
