"""Read a dataset's rows from a local file or folder: JSONL, parquet, or a saved HF `datasets` folder.

    >>> rows = read_rows("examples/math/train.jsonl")          # list of dicts
    >>> rows = read_rows("data/gsm8k.parquet")                 # needs pyarrow (flowrl[data])
    >>> rows = read_rows("data/gsm8k_saved", split="train")    # datasets.save_to_disk output
    >>> rows = read_rows("basic_arithmetic", "reasoning_gym", options={"size": 500, "seed": 1})

Everything is read once into memory (plain dicts): the prompt sets RL post-training uses are a few
MB to a few hundred MB. Nothing is ever downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

Format = Literal["auto", "jsonl", "parquet", "hf", "reasoning_gym"]


def detect_format(path: Path) -> str:
    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists() \
                or (path / "state.json").exists():
            return "hf"
        raise ValueError(f"{path} is a folder but not a saved Hugging Face dataset (no dataset_info.json "
                         "or dataset_dict.json); give a .jsonl or .parquet file, or a save_to_disk folder")
    suffix = "".join(path.suffixes[-2:]) if path.suffix == ".gz" else path.suffix
    if suffix in (".jsonl", ".json", ".jsonl.gz"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise ValueError(f"cannot tell the format of {path} from its suffix {suffix!r}; use .jsonl or "
                     ".parquet, or set `format: jsonl | parquet | hf`")


def read_rows(path: str | Path, format: Format = "auto", split: str | None = None,
              options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """All rows of a local dataset as dicts. Errors name the file, the line and the fix.

    ``format: reasoning_gym`` generates the rows instead: ``path`` is a reasoning-gym task name and
    ``options`` go to ``reasoning_gym.create_dataset`` (size, seed, the task's own knobs). Each row
    is ``{question, answer, entry}``; ``entry`` (the whole item, metadata included) is what the
    `reasoning_gym` reward term scores against, so use ``answer_field: entry``."""
    if format == "reasoning_gym":
        return _reasoning_gym(str(path), options or {})
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset {path} does not exist (paths are relative to the folder you run "
                                "flowrl from); write it first, e.g. python examples/math/make_problems.py")
    fmt = detect_format(path) if format == "auto" else format
    if fmt == "jsonl":
        return _read_jsonl(path)
    if fmt == "parquet":
        return _read_parquet(path)
    return _read_hf(path, split)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    import gzip

    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg}); every line must be one JSON object") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{n}: a line must be a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("reading parquet needs pyarrow: pip install 'flowrl[data]' (or pip install pyarrow)") from None
    return pq.read_table(path).to_pylist()


def _read_hf(path: Path, split: str | None) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise ImportError("reading a saved Hugging Face dataset needs `datasets`: pip install 'flowrl[data]'") from None
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split is None:
            if len(ds) != 1:
                raise ValueError(f"{path} holds splits {sorted(ds)}; choose one with `split:`")
            split = next(iter(ds))
        if split not in ds:
            raise ValueError(f"{path} has no split {split!r}; it has {sorted(ds)}")
        ds = ds[split]
    return ds.to_list()


def _reasoning_gym(name: str, options: dict[str, Any]) -> list[dict[str, Any]]:
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError("format: reasoning_gym needs the reasoning-gym package: pip install reasoning-gym") from None
    try:
        data = reasoning_gym.create_dataset(name, **options)
    except Exception as e:  # noqa: BLE001 - an unknown task name or option: say which
        raise ValueError(f"reasoning-gym cannot make dataset {name!r} with options {options}: {e}") from None
    return [{"question": e["question"], "answer": e["answer"], "entry": e} for e in data]
