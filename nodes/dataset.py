"""Dataset source: prompts from a local JSONL / parquet / saved Hugging Face dataset.

    dataset:
      kind: dataset
      config:
        path: examples/math/train.jsonl
        template: "Q: {question}\\nA:"        # or chat_template: true (HF models)
        answer_field: answer
        model: *model                          # its tokenizer tokenizes the prompts
        max_new_tokens: 6

Outputs what the built-in `prompts` node does, so the rollout takes it unchanged:

    prompts  ragged int64   each prompt's own token ids (flowrl.Ragged; no padding)
    targets  [B, A] int64   the reference answers as UTF-8 bytes, -1 padded (flowrl.data.answers)
    rows     [B]    int64   dataset row of each prompt (dropped by the rollout; for audits)
    meta     max_new_tokens, targets_encoding: "utf8",
             tokenizer: {type: char} | {type: hf, path}   (how the `rewards` node decodes responses)

Which rows a ticket gets is a pure function of (seed, ticket index, batch size, dataset)
(flowrl.data.order): a replayed or resumed ticket gets the same rows, and a run killed and resumed
sees every row exactly once per epoch.
"""

from typing import Any, Literal

from pydantic import Field

import flowrl
from flowrl.nodes.common import ModelConfig


class DataConfig(ModelConfig):
    """Where prompts come from and how they become tokens (shared by `dataset` and `evaluator`)."""

    path: str
    """Local `.jsonl` (`.jsonl.gz`), `.parquet`, or a folder written by `datasets.save_to_disk`."""
    format: Literal["auto", "jsonl", "parquet", "hf", "reasoning_gym"] = "auto"
    """File format; `auto` goes by the suffix (a folder is a saved HF dataset). `reasoning_gym`:
    `path` is a reasoning-gym task name, generated offline (see `options`)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """`reasoning_gym` only: arguments of `reasoning_gym.create_dataset` (size, seed, ...)."""
    split: str | None = None
    """Split of a saved `DatasetDict` (needed when it has several)."""
    template: str = "{question}"
    """Python format string over the row's fields, e.g. `"Q: {question}\\nA:"`."""
    chat_template: bool = False
    """Wrap the rendered template as a user message in the model's chat template (HF models)."""
    system: str | None = None
    """System message, with `chat_template: true`."""
    answer_field: str = "answer"
    """Row field with the reference answer (a string; lists / dicts, e.g. code tests, become JSON)."""
    max_new_tokens: int = Field(16, ge=1)
    """Generation budget per response (the rollout reads it from the batch)."""
    max_prompt_tokens: int | None = Field(None, ge=1)
    """A cap: a prompt longer than this is an error naming its row (None: no cap; the model's
    context still bounds prompt + response). Prompts are never padded."""


def load_data(c: DataConfig):
    """Rows, tokenizer and prompt builder of a config; errors name the file and the fix."""
    from flowrl.data import PromptBuilder, read_rows, tokenizer_for

    rows = read_rows(c.path, c.format, c.split, c.options)
    if not rows:
        raise ValueError(f"dataset {c.path} has no rows")
    if c.answer_field not in rows[0]:
        raise ValueError(f"dataset {c.path} has no field {c.answer_field!r} (fields: {sorted(rows[0])}); "
                         "set `answer_field:`")
    tokenizer = tokenizer_for(c.model)
    builder = PromptBuilder(tokenizer, c.template, c.chat_template, c.system)
    builder.ids(rows[0])  # a template naming a missing field fails here, not mid-run
    return rows, tokenizer, builder


class Dataset(flowrl.Source):
    """`schedule.batch_size` rows per ticket, shuffled per epoch."""

    class Config(DataConfig):
        shuffle: bool = True
        """A fresh seeded shuffle each epoch (False: file order)."""
        epochs: int | None = Field(None, ge=1)
        """Stop after this many passes: a ticket past the end is an error (None: cycle forever)."""
        seed: int | None = None
        """Shuffle seed; default: the graph's `seed`."""

    async def setup(self):
        from flowrl.data import answer_text

        c = self.config
        self.rows, self.tokenizer, self.builder = load_data(c)
        self.answer_text = answer_text
        self.seed = self.ctx.seed if c.seed is None else c.seed
        graph = self.ctx.graph
        if c.epochs is not None and graph is not None:
            need = graph.schedule.steps * graph.schedule.batch_size
            if need > c.epochs * len(self.rows):
                raise ValueError(
                    f"schedule.steps x batch_size = {graph.schedule.steps} x {graph.schedule.batch_size} = {need} "
                    f"prompts, but {c.epochs} epoch(s) of {c.path} hold {c.epochs * len(self.rows)}; raise "
                    f"`epochs` or lower schedule.steps to {c.epochs * len(self.rows) // graph.schedule.batch_size}")

    async def generate(self, ticket):
        import torch

        from flowrl.data import ENCODING, encode_answers, rows_for, ticket_start

        c = self.config
        ids, epochs = rows_for(self.seed, ticket_start(ticket), ticket.size, len(self.rows), c.shuffle)
        if c.epochs is not None and int(epochs.max()) >= c.epochs:
            raise ValueError(f"ticket {ticket.index} reaches epoch {int(epochs.max()) + 1} of {c.path}, "
                             f"past epochs={c.epochs}; raise `epochs` or lower schedule.steps")
        rows = [self.rows[i] for i in ids]
        ids_of = [self.builder.ids(r) for r in rows]
        if c.max_prompt_tokens is not None:
            for row, seq in zip(ids.tolist(), ids_of):
                if len(seq) > c.max_prompt_tokens:
                    raise ValueError(f"{c.path} row {row}: its prompt has {len(seq)} tokens, more than "
                                     f"max_prompt_tokens={c.max_prompt_tokens}; raise max_prompt_tokens (and the "
                                     "model's context) or shorten the template")
        prompts = flowrl.Ragged.from_sequences(ids_of, dtype="int64")
        targets = encode_answers([self.answer_text(r[c.answer_field]) for r in rows])
        self.ctx.recorder.gauge("data_epoch", float(epochs.max()), per_node=True)
        return flowrl.Batch(
            tensors={"prompts": prompts, "targets": torch.from_numpy(targets), "rows": torch.from_numpy(ids)},
            meta={"max_new_tokens": c.max_new_tokens,
                  "targets_encoding": ENCODING, "tokenizer": self.tokenizer.spec})
