"""Hugging Face tokenizer files for the built-in model's vocabularies (one token per character).

The task vocabulary (18 ids, `flowrl.tasks.vocab`) and the text vocabulary (102 ids,
`flowrl.data.tokenizer`) become a `tokenizers` WordLevel model over single characters, with a
template that puts BOS first -- so ``AutoTokenizer.from_pretrained(out)("12+3")`` gives the ids
flowrl's own tokenizer gives.
"""

from __future__ import annotations

from pathlib import Path


def char_vocab(vocab_size: int) -> tuple[dict[str, int], dict[str, str]]:
    """token -> id for a tiny model of ``vocab_size`` ids, and the special-token names."""
    from flowrl.data.tokenizer import CHAR_IDS, TEXT_VOCAB_SIZE
    from flowrl.tasks.vocab import _SYMBOLS, BOS, EOS, PAD, VOCAB_SIZE

    if vocab_size >= TEXT_VOCAB_SIZE:
        specials = {"<bos>": BOS, "<eos>": EOS, "<pad>": PAD, "<rev>": 15, "<sort>": 16, "<add>": 17}
        vocab = {**CHAR_IDS, **specials}
        names = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<pad>"}
        first_extra = TEXT_VOCAB_SIZE
    else:
        vocab = {ch: i for i, ch in enumerate(_SYMBOLS)}
        names = {"bos_token": _SYMBOLS[BOS], "eos_token": _SYMBOLS[EOS], "pad_token": _SYMBOLS[PAD],
                 "unk_token": _SYMBOLS[PAD]}
        first_extra = VOCAB_SIZE
    vocab.update({f"<extra_{i}>": i for i in range(first_extra, vocab_size)})
    return vocab, names


def save_char_tokenizer(out: str | Path, vocab_size: int) -> None:
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )
    from transformers import PreTrainedTokenizerFast

    vocab, names = char_vocab(vocab_size)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=names["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    bos = names["bos_token"]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, vocab[bos])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **names)
    fast.save_pretrained(str(out))
