"""A tiny random chat model with tool calls: a Hugging Face Llama folder for chat and agent tests.

    from flowrl.testing.chat_model import write_chat_model
    path = write_chat_model(tmp_path / "chat", seed=0)          # ~0.2M parameters, no download
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=[...], add_generation_prompt=True)
    model: {type: hf, path: <path>}                              # flowrl's builtin and hf engines run it

Like ``examples/hf_tiny/make_model.py`` (read it first) the folder is an ordinary checkpoint, but
the tokenizer is a chat one: one token per printable ASCII character and newline, plus the
ChatML/Hermes tokens ``<|im_start|>``, ``<|im_end|>`` (EOS: it ends a model turn),
``<tool_call>``, ``</tool_call>`` and ``<|endoftext|>`` (pad and unknown). The chat template is
Qwen2.5's: tools listed as JSON inside ``<tools></tools>`` in the system prompt, an assistant's
tool calls rendered as ``<tool_call>\\n{"name": .., "arguments": {..}}\\n</tool_call>``, and tool
results as a user turn of ``<tool_response>`` blocks. So token ids are easy to reason about in a
test (``"a"`` is one token, ``<tool_call>`` is one token) while the template does what a real
Qwen/Hermes checkpoint's does.

As in Qwen2.5, ``<tool_call>`` and ``</tool_call>`` are *not* special tokens: decoding a model
turn with ``skip_special_tokens=True`` keeps them, so a parser can find the calls in the text.

Weights are a pure function of ``seed``: two calls write bitwise the same model.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

IM_START, IM_END, TOOL_CALL, TOOL_CALL_END, ENDOFTEXT = (
    "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<|endoftext|>")
SPECIAL = (ENDOFTEXT, IM_START, IM_END)
"""Special tokens (dropped by ``decode(skip_special_tokens=True)``): ids 0, 1, 2."""
TOOL_TOKENS = (TOOL_CALL, TOOL_CALL_END)
"""Added but not special (kept in decoded text, as in Qwen2.5): ids 3, 4."""
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
"""Every character the tokenizer spells, one token each (ids 5 ...)."""

DEFAULT_SYSTEM = "You are a helpful assistant."

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- '" + DEFAULT_SYSTEM + "' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- else %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2.5-Instruct's template (its default system prompt shortened). Tool-call ``arguments`` are
rendered with ``tojson``: pass them as a dict, as transformers expects."""


def write_chat_tokenizer(out: Path) -> None:
    """The character tokenizer with the chat tokens, saved as ``PreTrainedTokenizerFast``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    assert len(set(CHARS)) == len(CHARS) == 96 and set(string.printable) - set(CHARS) <= set("\t\r\x0b\x0c")
    vocab = {tok: i for i, tok in enumerate((*SPECIAL, *TOOL_TOKENS, *CHARS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=ENDOFTEXT))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every char, newline too
    tok.decoder = decoders.Fuse()
    # Added tokens are matched in the text before the per-character split: "<tool_call>" is one id.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT, unk_token=ENDOFTEXT,
        chat_template=CHAT_TEMPLATE, model_max_length=4096, clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(out)


def write_chat_model(path: str | Path, seed: int = 0, *, hidden: int = 64, layers: int = 2,
                     max_len: int = 4096) -> Path:
    """Write the model (random Llama, ``hidden`` wide, ``layers`` deep) and the chat tokenizer into
    ``path``; returns it. ``max_len`` is ``max_position_embeddings``: tool prompts spelled one
    character per token are long (the tools system prompt alone is ~300 tokens)."""
    import torch
    import transformers

    out = Path(path)
    vocab_size = len(SPECIAL) + len(TOOL_TOKENS) + len(CHARS)
    eos, pad = SPECIAL.index(IM_END), SPECIAL.index(ENDOFTEXT)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_len,
        bos_token_id=SPECIAL.index(IM_START), eos_token_id=eos, pad_token_id=pad, tie_word_embeddings=False,
        initializer_range=0.02, torch_dtype="float32",
    )
    transformers.logging.set_verbosity_error()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    # No sampling defaults: the rollout's config is the one place sampling is set.
    gen = {"bos_token_id": SPECIAL.index(IM_START), "eos_token_id": eos, "pad_token_id": pad}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    write_chat_tokenizer(out)
    return out


if __name__ == "__main__":  # python -m flowrl.testing.chat_model models/hf-chat-tiny [--hidden 128]
    import argparse

    ap = argparse.ArgumentParser(description="Write a tiny random chat model (ChatML + Hermes tools, one token per character).")
    ap.add_argument("path")
    ap.add_argument("--hidden", type=int, default=128, help="width (128: 4 heads of 32, a head size vLLM's CPU build takes)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(write_chat_model(a.path, a.seed, hidden=a.hidden))
