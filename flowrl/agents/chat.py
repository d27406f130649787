"""Chat formats: a conversation as token ids, one model turn at a time, never re-tokenizing a turn.

    >>> fmt = chat_format({"type": "tiny", "vocab_size": 102})
    >>> ids = fmt.start([{"role": "user", "content": "12*34"}])   # BOS 1 2 * 3 4 \\n
    >>> ids += completion.tokens                                  # the engine's, EOS included  # doctest: +SKIP
    >>> ids += fmt.extend([{"role": "tool", "content": "408"}])   # 4 0 8 \\n        # doctest: +SKIP
    >>> fmt.tool_calls("=12*34")
    [ToolCall(name='calc', arguments={'expr': '12*34'}, id='call_0')]

Two formats, picked from the model by :func:`chat_format`:

- :class:`CharChat`, the built-in tiny model with the character vocabulary
  (``flowrl.data.tokenizer.CharTokenizer``). It has no chat template, so the layout is the
  smallest one that keeps turns apart: ``start`` = BOS, then each message's content followed by a
  newline; the model's turn ends with EOS (kept as generated); ``extend`` = each new message's
  content and a newline (no BOS). Roles are not rendered: a task's messages say what they are by
  their content (the model learns them from scratch anyway). Tools are not rendered either; the
  compact call form is a turn that starts with ``=``: ``=EXPR`` is ``calc(expr=EXPR)``, EXPR
  being the longest run of arithmetic characters (digits, ``+-*/%(). ``) after the ``=`` (what
  follows it is ignored) -- one character of syntax a model can discover by RL from random
  weights. Hermes blocks (below) are
  parsed too.
- :class:`TemplateChat`, a Hugging Face tokenizer with a chat template. ``start`` is
  ``apply_chat_template(messages, tools=tools, add_generation_prompt=True)``. ``extend`` renders a
  fixed dummy conversation ending in an assistant turn, with and without the new messages (the
  latter plus a generation prompt), and keeps what follows the assistant turn's stop token: the
  template's text after ``<|im_end|>`` (ChatML's newline), the new messages, the next generation
  prompt. Earlier turns are never rendered again, so ``start + model tokens (ending in the stop
  id) + extend`` equals what the template gives for the whole conversation wherever the template
  renders a turn independently of the turns around it (ChatML / Qwen / Llama-3 style; a template
  that rewrites earlier turns, e.g. dropping old reasoning, differs there -- by design, the
  trainer must see what the engine saw). Tool calls are Hermes-style
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; a block that is not valid
  JSON becomes ``ToolCall(name="", arguments={"error": ..., "raw": ...})`` (the tool runner answers
  it with the error), never an exception.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from flowrl.agents.base import ToolCall

_COMPACT = re.compile(r"=([0-9+\-*/%(). ]*)")
_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)

STOP_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
"""End-of-turn tokens of common chat templates: each one the tokenizer knows is a stop id."""


def hermes_tool_calls(text: str) -> list[ToolCall]:
    """``<tool_call>{"name": .., "arguments": {..}}</tool_call>`` blocks, in order (an unclosed last
    block is read to the end of the text). A bad block is a ToolCall named "" with the error."""
    calls = []
    for i, m in enumerate(_HERMES.finditer(text)):
        raw = m.group(1).strip()
        try:
            obj = json.loads(raw)
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
                raise ValueError('a tool call must be a JSON object with a "name" string')
            args = obj.get("arguments", obj.get("parameters", {}))
            if isinstance(args, str):
                args = json.loads(args) if args.strip() else {}
            if not isinstance(args, dict):
                raise ValueError(f'"arguments" must be a JSON object, got {type(args).__name__}')
            calls.append(ToolCall(obj["name"], args, str(obj.get("id", f"call_{i}"))))
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            calls.append(ToolCall("", {"error": f"bad tool call: {e}", "raw": raw[:500]}, f"call_{i}"))
    return calls


class CharChat:
    """The built-in model's layout (see the module docstring)."""

    def __init__(self, compact_tool: str = "calc", compact_arg: str = "expr"):
        from flowrl.data.tokenizer import CharTokenizer

        self.tok = CharTokenizer()
        self.stop_ids = (self.tok.eos_id,)
        self.compact_tool, self.compact_arg = compact_tool, compact_arg

    def _ids(self, messages: list[dict[str, Any]]) -> list[int]:
        text = "".join(str(m.get("content", "")) + "\n" for m in messages)
        return self.tok.encode(text)[1:]  # encode puts a BOS first

    def start(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        return [self.tok.bos_id, *self._ids(messages)]

    def extend(self, messages: list[dict[str, Any]]) -> list[int]:
        return self._ids(messages)

    def text(self, tokens: Sequence[int]) -> str:
        return self.tok.decode(tokens)

    def tool_calls(self, text: str) -> list[ToolCall]:
        if "<tool_call>" in text:
            return hermes_tool_calls(text)
        m = _COMPACT.match(text)
        if m:
            return [ToolCall(self.compact_tool, {self.compact_arg: m.group(1).strip()}, "call_0")]
        return []


class TemplateChat:
    """A Hugging Face tokenizer's chat template, extended by deltas (see the module docstring)."""

    BASE = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    PLACEHOLDER = {"role": "assistant", "content": "a"}

    def __init__(self, tokenizer: Any, stop_ids: Sequence[int] | None = None):
        self.tok = tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; an "
                             "agent needs one (or the built-in model's format: model {type: tiny})")
        if stop_ids is None:
            vocab = tokenizer.get_vocab()
            found = [tokenizer.eos_token_id] + [vocab[t] for t in STOP_TOKENS if t in vocab]
            stop_ids = [int(i) for i in found if i is not None]
        self.stop_ids = tuple(dict.fromkeys(stop_ids))
        self.tools: list[dict[str, Any]] | None = None
        self._after: list[int] | None = None

    def render(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
               generation_prompt: bool = True) -> list[int]:
        ids = self.tok.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                           tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns an encoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def start(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        self.tools = tools
        return self.render(messages, tools=tools)

    def extend(self, messages: list[dict[str, Any]]) -> list[int]:
        base = [*self.BASE, self.PLACEHOLDER]
        prefix = self.render(base, tools=self.tools, generation_prompt=False)
        full = self.render(base + list(messages), tools=self.tools)
        cut = self._assistant_end(prefix)
        if full[:cut] != prefix[:cut]:
            raise ValueError("the chat template renders earlier turns differently once more messages follow; "
                             "extend cannot append without re-tokenizing them (use a template that renders "
                             "each turn on its own, e.g. ChatML)")
        return full[cut:]

    def _assistant_end(self, prefix: list[int]) -> int:
        """Where the dummy assistant turn's stop token ends (what the engine's tokens end with);
        the template's text after it (ChatML's newline) belongs to the delta."""
        for j in range(len(prefix) - 1, -1, -1):
            if prefix[j] in self.stop_ids:
                return j + 1
        return len(prefix)

    def text(self, tokens: Sequence[int]) -> str:
        return self.tok.decode([int(t) for t in tokens], skip_special_tokens=True)

    def tool_calls(self, text: str) -> list[ToolCall]:
        return hermes_tool_calls(text)


def chat_format(model: Any, **kwargs: Any) -> CharChat | TemplateChat:
    """The chat format of ``model``: a model spec (``{type: tiny, ...}`` / ``{type: hf, path}``), a
    flowrl tokenizer (``flowrl.data.tokenizer_for``) or a ``transformers`` tokenizer."""
    from flowrl.data.tokenizer import CharTokenizer, HFTokenizer, tokenizer_for

    if isinstance(model, (CharChat, TemplateChat)):
        return model
    if hasattr(model, "apply_chat_template"):
        return TemplateChat(model, **kwargs)
    if not isinstance(model, (CharTokenizer, HFTokenizer)):
        model = tokenizer_for(model)
    if isinstance(model, CharTokenizer):
        return CharChat(**kwargs)
    return TemplateChat(model.tok, **kwargs)
