"""Write a small random-initialised Llama and a character tokenizer for the built-in digit tasks.

    python examples/hf_tiny/make_model.py                          # models/hf-tiny (2 x 128, ~0.5M)
    python examples/hf_tiny/make_model.py models/llama-113m --preset 100m
    flowrl run graphs/grpo-vllm.yaml                               # trains the first one

The folder is an ordinary Hugging Face checkpoint (``config.json``, ``model.safetensors``,
``generation_config.json``, ``tokenizer.json`` + ``tokenizer_config.json`` with a chat template),
so ``transformers``, vLLM and flowrl's ``{type: hf, path: ...}`` all load it without a hub. The
tokenizer is one token per character of ``flowrl.tasks.vocab`` -- token 7 is the digit ``7``,
``^`` BOS, ``$`` EOS, ``_`` PAD -- so the tasks' prompts, targets and rewards work unchanged:
``tokenizer.encode("^R4183=") == flowrl.tasks.encode("^R4183=")``.

Weights are a pure function of ``--seed``: two calls write bitwise the same model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PRESETS = {
    # name: hidden, intermediate, layers, heads, kv heads, head size, rope theta
    "tiny": (128, 256, 2, 8, 8, 32, 100.0),
    "100m": (768, 3072, 12, 12, 4, 64, 10000.0),
}
"""The tiny preset is shaped for learning digit reversal by RL from random weights (measured with
GRPO on 3 digits, see graphs/grpo-vllm.yaml): a Llama has no absolute positions, so reversing
means building a two-layer circuit (a previous-token head, then a head that finds the current
digit in the prompt and copies the one before it). Eight full heads (no grouped keys/values) and
a rotary base of 100 instead of 10000 (at sequences under 20 tokens most of the default base's
frequencies turn too slowly to tell neighbours apart) made that circuit form sooner and more
surely than the first shape (4 heads, 2 kv heads, base 10000). The head size stays 32 (wider
than 128 / 8): vLLM's CPU attention supports head sizes 32, 64, 80, ... only."""


CHAT_TEMPLATE = (
    "{{ bos_token if not messages or not messages[0]['content'].startswith(bos_token) else '' }}"
    "{% for message in messages %}{{ message['content'] }}{% endfor %}"
)
"""The digit tasks have no roles: a conversation renders as its contents, after one BOS."""


def write_tokenizer(out: Path) -> None:
    """A WordLevel tokenizer over single characters, saved as ``PreTrainedTokenizerFast``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from flowrl.tasks.vocab import _SYMBOLS, BOS, EOS, PAD

    vocab = {ch: i for i, ch in enumerate(_SYMBOLS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=_SYMBOLS[PAD]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=_SYMBOLS[BOS], eos_token=_SYMBOLS[EOS], pad_token=_SYMBOLS[PAD],
        unk_token=_SYMBOLS[PAD], chat_template=CHAT_TEMPLATE, model_max_length=4096, clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(out)


def write_model(out: Path, preset: str = "tiny", *, seed: int = 0, max_len: int = 128) -> Path:
    """Write the model and tokenizer into ``out``; returns ``out``."""
    import torch
    import transformers

    from flowrl.tasks.vocab import BOS, EOS, PAD, VOCAB_SIZE

    hidden, inter, layers, heads, kv, head_dim, theta = PRESETS[preset]
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=max_len, rope_theta=theta,
        head_dim=head_dim,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False,
        initializer_range=0.02, torch_dtype="float32",
    )
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    # No sampling defaults: the graph's rollout config is the one place sampling is set.
    gen = {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    write_tokenizer(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default="models/hf-tiny", help="folder to write (default models/hf-tiny)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-len", type=int, default=128, help="max_position_embeddings")
    args = parser.parse_args(argv)
    path = write_model(Path(args.out), args.preset, seed=args.seed, max_len=args.max_len)
    n = sum(1 for _ in path.iterdir())
    print(f"wrote {args.preset} Llama + character tokenizer to {path} ({n} files)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
