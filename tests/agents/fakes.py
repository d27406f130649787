"""Small fakes for the agent tests: scripted generators, scripted environments, a ChatML tokenizer."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from flowrl.agents.base import Completion, ServiceError, Step

CHATML = (
    "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chatml_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` with ChatML's special tokens and template."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|endoftext|>"))
    tok.add_special_tokens(specials)
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHATML
    return fast


class ScriptedGen:
    """Answers each request with the next scripted turn (token ids), stop id appended; records prompts."""

    def __init__(self, turns: Sequence[Sequence[int]], *, stop: int | None = None, version: int = 3,
                 fail_at: int | None = None, hang: bool = False):
        self.turns, self.stop, self.version = [list(t) for t in turns], stop, version
        self.fail_at, self.hang = fail_at, hang
        self.prompts: list[list[int]] = []
        self.completions: list[Completion] = []

    async def complete(self, prompt, *, session, max_new_tokens, stop=(), min_version=0, seed=0, timeout_s=None):
        self.prompts.append(list(prompt))
        if self.fail_at is not None and len(self.prompts) - 1 >= self.fail_at:
            raise ServiceError("replica 0 refused the request: shutting down")
        if self.hang:
            await asyncio.Event().wait()
        k = len(self.prompts) - 1
        toks = list(self.turns[k % len(self.turns)])
        end = self.stop if self.stop is not None else (stop[0] if stop else None)
        if end is not None:
            toks.append(end)
        toks = toks[:max_new_tokens]
        out = Completion(toks, [-0.5 - 0.01 * j for j in range(len(toks))], [self.version] * len(toks),
                         "stop" if end in toks else "length")
        self.completions.append(out)
        return out


class EchoEnv:
    """Replies "ok" to every turn, gives reward 0.25 per turn, done after ``turns`` turns."""

    def __init__(self, turns: int = 3, fail_on: str | None = None, hang_on: str | None = None):
        import threading

        self.turns, self.fail_on, self.hang_on = turns, fail_on, hang_on
        self.release = threading.Event()
        self.n, self.seen = 0, []

    def reset(self, task):
        if self.fail_on == "reset":
            raise RuntimeError("no such task")
        return [{"role": "user", "content": f"task {task['index']}"}]

    def step(self, text):
        if self.fail_on == "step":
            raise KeyError("state lost")
        if self.hang_on == "step":
            self.release.wait(10)  # a sync env stuck in I/O: only the deadline gets the episode out
        self.n += 1
        self.seen.append(text)
        return Step(messages=[{"role": "user", "content": "ok"}], reward=0.25, done=self.n >= self.turns)


class AsyncHangEnv(EchoEnv):
    async def step(self, text):
        await asyncio.Event().wait()
