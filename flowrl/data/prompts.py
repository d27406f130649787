"""Turn dataset rows into prompt token ids: a format-string template or the model's chat template.

    >>> build = PromptBuilder(CharTokenizer(), template="Q: {question}\\nA:")
    >>> build.ids({"question": "2+3?", "answer": "5"})[:4]
    [12, 55, 33, 18]
    >>> left_pad([[1, 2], [3]], pad_id=14)
    array([[ 1,  2], [14,  3]])

The dataset source sends each prompt with its own length (a `flowrl.Ragged`); the engines pad
internally behind an attention mask, so no model attends a pad token. `left_pad` remains for code
that wants one rectangular array of prompts.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flowrl.data.tokenizer import TextTokenizer


class PromptBuilder:
    def __init__(self, tokenizer: TextTokenizer, template: str = "{question}", chat_template: bool = False,
                 system: str | None = None):
        self.tokenizer, self.template, self.chat_template, self.system = tokenizer, template, chat_template, system

    def text(self, row: dict[str, Any]) -> str:
        try:
            return self.template.format_map(row)
        except KeyError as e:
            raise ValueError(f"template {self.template!r} uses field {e.args[0]!r}, but the dataset rows have "
                             f"fields {sorted(row)}; change `template:` (write fields as {{name}})") from None

    def ids(self, row: dict[str, Any]) -> list[int]:
        text = self.text(row)
        if not self.chat_template:
            return self.tokenizer.encode(text)
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + \
                   [{"role": "user", "content": text}]
        return self.tokenizer.chat(messages)


def left_pad(seqs: list[list[int]], pad_id: int, length: int | None = None) -> np.ndarray:
    """int64 ``[n, L]``: each sequence right-aligned, ``pad_id`` before it (L = longest or `length`)."""
    longest = max((len(s) for s in seqs), default=1)
    width = longest if length is None else length
    if longest > width:
        raise ValueError(f"a prompt has {longest} tokens but max_prompt_tokens={width}; raise "
                         "max_prompt_tokens (and the model's max_seq_len) or shorten the template")
    out = np.full((len(seqs), width), pad_id, dtype=np.int64)
    for i, s in enumerate(seqs):
        if s:
            out[i, width - len(s):] = s
    return out
