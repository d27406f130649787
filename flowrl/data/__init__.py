"""Datasets for RL post-training: local files in, prompt batches out, resumable exactly.

    rows = read_rows("examples/math/train.jsonl")                # JSONL, parquet or a saved HF dataset
    tok = tokenizer_for({"type": "tiny", "vocab_size": 102})     # or {type: hf, path: ...}
    build = PromptBuilder(tok, template="Q: {question}\\nA:")
    ids, epochs = rows_for(seed=0, start=ticket_start(ticket), count=8, n_rows=len(rows))

The `dataset` node (nodes/dataset.py) puts these together. Nothing here imports torch; pyarrow,
datasets and transformers are imported only when a parquet file, a saved dataset or a Hugging Face
tokenizer is used (pip install 'flowrl[data]').
"""

from flowrl.data.answers import ENCODING, answer_text, decode_answers, encode_answers
from flowrl.data.order import epoch_order, rows_for, rows_for_ticket, ticket_start
from flowrl.data.prompts import PromptBuilder, left_pad
from flowrl.data.readers import read_rows
from flowrl.data.tokenizer import (
    TEXT_VOCAB_SIZE,
    CharTokenizer,
    TextTokenizer,
    tokenizer_for,
)

__all__ = [
    "ENCODING", "TEXT_VOCAB_SIZE", "CharTokenizer", "PromptBuilder", "TextTokenizer", "answer_text",
    "decode_answers", "encode_answers", "epoch_order", "left_pad", "read_rows", "rows_for",
    "rows_for_ticket", "ticket_start", "tokenizer_for",
]
