"""Local datasets: JSONL, parquet and saved Hugging Face folders read into the same rows."""

import json

import pytest

from flowrl.data import read_rows

ROWS = [{"question": "Ann has 2 cups and gets 3 more. How many cups?", "answer": "5"},
        {"question": "Bob has 9 pens and gives away 4. How many pens?", "answer": "5"}]


def test_jsonl_rows_are_read_and_a_bad_line_is_named(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS) + "\n")
    assert read_rows(path) == ROWS
    path.write_text(json.dumps(ROWS[0]) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"d.jsonl:2: not valid JSON"):
        read_rows(path)


def test_parquet_rows_are_read(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    assert read_rows(path) == ROWS


def test_a_saved_hugging_face_dataset_is_read_by_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:1])})
    dd.save_to_disk(str(tmp_path / "saved"))
    assert read_rows(tmp_path / "saved", split="test") == ROWS[:1]
    with pytest.raises(ValueError, match="choose one with `split:`"):
        read_rows(tmp_path / "saved")


def test_a_missing_file_or_an_unknown_suffix_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_rows(tmp_path / "nope.jsonl")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="use .jsonl or .parquet"):
        read_rows(tmp_path / "d.csv")
