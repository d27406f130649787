"""The recovery book on its own: what commits, what an epoch change abandons, what is kept."""

import json

import pytest

from flowrl.runtime.protocol.checkpoints import CheckpointError, confine, read_latest
from flowrl.runtime.protocol.ledger import Ledger, read_jsonl
from flowrl.runtime.controller.recovery import RecoveryBook

MEMBERS = ["actor/0/0", "critic/0/0"]


def book(tmp_path, keep=2):
    return RecoveryBook(tmp_path, MEMBERS, keep=keep, ledger=Ledger(tmp_path / "ledger.jsonl"), publishers=["actor"])


def save(tmp_path, b, proc, step, epoch=0, version=0):
    name = f"step{step:08d}/{proc.replace('/', '.')}.e{epoch}.pt"
    (tmp_path / "checkpoints" / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "checkpoints" / name).write_bytes(b"x")
    return b.report(proc, step=step, epoch=epoch, file=name, version=version)


def test_a_checkpoint_commits_only_when_every_stateful_node_saved_it_and_every_sink_passed_it(tmp_path):
    b = book(tmp_path)
    save(tmp_path, b, "actor/0/0", 5, version=5)
    assert b.committable(complete_below=10) is None  # the critic has not saved 5
    save(tmp_path, b, "critic/0/0", 5)
    assert b.committable(complete_below=4) is None  # ticket 4 is not consumed by every sink yet
    assert b.committable(complete_below=5) == 5
    record = b.commit(5, {})
    assert record["version"] == 5 and set(record["files"]) == set(MEMBERS)
    assert read_latest(tmp_path)["step"] == 5
    assert [r["event"] for r in read_jsonl(tmp_path / "ledger.jsonl")] == ["checkpoint"]  # fsynced with it


def test_a_restart_during_a_checkpoint_abandons_it_and_old_epoch_reports_never_count(tmp_path):
    b = book(tmp_path)
    save(tmp_path, b, "actor/0/0", 5)
    assert b.begin_recovery() == 1
    assert not save(tmp_path, b, "critic/0/0", 5, epoch=0)  # the dead epoch's file
    assert b.committable(complete_below=10) is None and b.committed is None
    save(tmp_path, b, "actor/0/0", 5, epoch=1)
    save(tmp_path, b, "critic/0/0", 5, epoch=1)
    assert b.commit(b.committable(10), {})["files"]["critic/0/0"].endswith(".e1.pt")


def test_old_checkpoints_are_pruned_to_keep_and_partial_saves_below_the_last_commit_go(tmp_path):
    b = book(tmp_path, keep=2)
    for step in (5, 10, 15):
        for p in MEMBERS:
            save(tmp_path, b, p, step)
        b.commit(step, {})
    save(tmp_path, b, "actor/0/0", 20)
    kept = sorted(p.name for p in (tmp_path / "checkpoints").glob("step*"))
    assert kept == ["step00000010", "step00000015", "step00000020"]  # 20 is being written


def test_paths_outside_the_run_directory_are_refused(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    for bad in ("../../x.pt", "/etc/passwd", "", 5, "a/../../b"):
        with pytest.raises(CheckpointError):
            confine(root, bad)
    (root / "latest.json").write_text(json.dumps({"step": 3, "files": {"actor/0/0": "../../evil.pt"}}))
    with pytest.raises(CheckpointError, match="outside"):
        read_latest(tmp_path)


def test_a_checkpoint_holding_pickled_code_is_refused(tmp_path):
    import torch

    from flowrl.runtime.protocol.checkpoints import load_state

    class Evil:
        def __reduce__(self):
            return (print, ("ran",))

    path = tmp_path / "evil.pt"
    torch.save({"node": Evil()}, path)
    with pytest.raises(CheckpointError, match="plain-data"):
        load_state(path)


def test_a_long_ledger_rotates_into_compressed_segments_and_reads_back_whole(tmp_path):
    from flowrl.runtime.protocol.ledger import TicketIssued, read_ledger

    ledger = Ledger(tmp_path / "ledger.jsonl", rotate_bytes=2000)
    for i in range(300):
        ledger.record(TicketIssued(batch_id=f"t-{i:06d}", index=i, min_version=0))
        if i % 50 == 49:
            ledger.sync()  # a checkpoint commit
    ledger.close()
    assert len(list(tmp_path.glob("ledger.*.jsonl.gz"))) >= 2
    assert [r["index"] for r in read_ledger(tmp_path)] == list(range(300))


def test_a_long_runs_metrics_rows_rotate_into_segments_and_read_back_whole(tmp_path):
    from flowrl.metrics import MetricsHub
    from flowrl.segments import read_all, segments

    hub = MetricsHub(tmp_path)
    hub.rotate_bytes = 3000
    for i in range(60):
        hub.end_step(step=i + 1)
    hub.close()
    assert len(segments(tmp_path / "metrics.jsonl")) >= 2
    assert [r["step"] for r in read_all(tmp_path / "metrics.jsonl")] == list(range(1, 61))


def test_a_segment_left_uncompressed_is_read_in_its_place_and_numbering_goes_on_after_it(tmp_path):
    """A crash between writing a segment and compressing it leaves `name.N.jsonl`: rows read whole,
    in order, and the next rotation takes the number after it (a `.gz` of a number wins over the file)."""
    from flowrl.segments import compress, read_all, rotate, segments

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n')
    rotate(path)  # metrics.1.jsonl.gz
    (tmp_path / "metrics.2.jsonl").write_text('{"step": 2}\n')
    path.write_text('{"step": 3}\n')
    assert [r["step"] for r in read_all(path)] == [1, 2, 3]
    assert rotate(path).name == "metrics.3.jsonl.gz"
    (tmp_path / "metrics.1.jsonl").write_text('{"step": 99}\n')  # stale: the .gz of that number is whole
    assert [p.name for p in segments(path)] == ["metrics.1.jsonl.gz", "metrics.2.jsonl", "metrics.3.jsonl.gz"]
    compress(tmp_path / "metrics.2.jsonl")
    assert [p.name for p in segments(path)] == ["metrics.1.jsonl.gz", "metrics.2.jsonl.gz", "metrics.3.jsonl.gz"]
    assert [r["step"] for r in read_all(path)] == [1, 2, 3]
