"""No shared filesystem, without Ray (`launcher.host_dirs`, docs/multi-host.md): where a process
keeps its files, what the commit record says about each shard, the local launcher's copy of a
shard (digest checked), pruning in host folders, and a log the controller cannot read.
The Ray fetch and the two-host runs are in tests/ray/test_no_shared_fs.py."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace

import pytest

from flowrl.runtime.protocol.checkpoints import CheckpointError, host_folder
from flowrl.runtime.protocol.ledger import Ledger, read_jsonl
from flowrl.runtime.protocol.procspec import ProcSpec


class Events:
    def __init__(self):
        self.rows = []

    def record(self, event):
        self.rows.append(event)


def shard_setup(tmp_path: Path, payload: bytes):
    b_dir, a_dir = tmp_path / "b" / "run", tmp_path / "a" / "run"
    name = "step00000005/actor.0.0.e0.pt"
    (b_dir / "checkpoints" / name).parent.mkdir(parents=True)
    (b_dir / "checkpoints" / name).write_bytes(payload)
    digest = hashlib.sha256(payload).hexdigest()
    record = {"step": 5, "files": {"actor/0/0": name},
              "shards": {"actor/0/0": {"file": name, "sha256": digest, "size": len(payload), "host": "host-b",
                                       "folder": str(b_dir)}}}
    return a_dir, b_dir, name, digest, record


def test_the_local_launcher_copies_a_shard_between_folders_digest_checked(tmp_path):
    from flowrl.runtime.controller.shards import ensure_shard, needs_fetch
    from flowrl.runtime.launch.launcher import SubprocessLauncher

    payload = b"state" * 1000
    a_dir, b_dir, name, digest, record = shard_setup(tmp_path, payload)
    dst = a_dir / "checkpoints" / name
    spec = SimpleNamespace(proc_id="actor/0/0", host="host-a", home=str(a_dir), resume_from=str(dst))
    ensure_shard(SimpleNamespace(committed=record), spec, SubprocessLauncher(), {"host-b": "x"}, Events())
    assert dst.read_bytes() == payload
    # hosts that share the run directory (neither listed): the same folder is the same file
    shard = record["shards"]["actor/0/0"]
    assert not needs_fetch(shard, "host-c", str(b_dir), {})
    assert needs_fetch(shard, "host-c", str(b_dir), {"host-b": "x"})
    assert not needs_fetch(shard, "host-b", str(b_dir), {"host-b": "x"})
    # the holder's file changed: refused, named
    dst.unlink()
    (b_dir / "checkpoints" / name).write_bytes(b"other")
    with pytest.raises(CheckpointError, match=f"held by host 'host-b'.*not the committed {digest}"):
        ensure_shard(SimpleNamespace(committed=record), spec, SubprocessLauncher(), {"host-b": "x"}, Events())
    assert not dst.exists()


def test_the_commit_record_names_each_shards_file_digest_size_host_and_folder(tmp_path):
    from flowrl.runtime.controller.recovery import RecoveryBook

    book = RecoveryBook(tmp_path, ["actor/0/0", "critic/0/0"], keep=2, ledger=Ledger(tmp_path / "ledger.jsonl"))
    shard = {"sha256": "ab" * 32, "size": 7, "host": "host-b", "folder": "/disk/run"}
    book.report("actor/0/0", step=5, epoch=0, file="step00000005/actor.0.0.e0.pt", version=5, shard=shard)
    book.report("critic/0/0", step=5, epoch=0, file="step00000005/critic.0.0.e0.pt", version=0)  # no digest: shared
    record = book.commit(5, {})
    assert record["shards"] == {"actor/0/0": {"file": "step00000005/actor.0.0.e0.pt", **shard}}
    assert record["files"]["critic/0/0"] == "step00000005/critic.0.0.e0.pt"
    assert book.file_for("actor/0/0", "/disk/run") == "/disk/run/checkpoints/step00000005/actor.0.0.e0.pt"
    assert book.file_for("critic/0/0") == str((tmp_path / "checkpoints/step00000005/critic.0.0.e0.pt").resolve())
    assert [r["event"] for r in read_jsonl(tmp_path / "ledger.jsonl")] == ["checkpoint"]


def test_a_process_on_a_listed_host_keeps_its_files_and_graph_copy_in_that_hosts_folder(tmp_path):
    from flowrl.runtime.controller.procs import Proc
    from flowrl.runtime.worker.pidfile import pid_file
    from flowrl.runtime.worker.startup import own_graph_file

    run_dir = tmp_path / "runs" / "ppo-1"
    assert host_folder(run_dir, {"host-b": str(tmp_path / "disk")}, "host-b") == tmp_path / "disk" / "ppo-1"
    assert host_folder(run_dir, {"host-b": str(tmp_path / "disk")}, "host-a") == run_dir
    own = tmp_path / "disk" / "ppo-1"
    spec = ProcSpec(node="actor", kind="k", replica=0, replicas=1, rank=0, world_size=1, incarnation=0,
                    run_dir=str(run_dir), graph_file=str(own / "graph.yaml"), control="ipc://x", host="host-b",
                    own_dir=str(own), graph_text="name: g\n")
    assert spec.home == str(own) and pid_file(spec) == own / "procs" / "actor.0.0.pid"
    assert own_graph_file(spec) == str(own / "graph.yaml") and (own / "graph.yaml").read_text() == "name: g\n"
    assert not run_dir.exists()  # nothing of the controller's folder is needed (or made) there
    # the controller cannot read that log: the failure text says where it is
    assert Proc(spec).log_tail(run_dir) == f"(the log is on host 'host-b' at {own}/logs/actor.0.0.log; read it there)"
    (own / "logs").mkdir()
    (own / "logs" / "actor.0.0.log").write_text("boom\n")
    assert Proc(spec).log_tail(run_dir) == "boom"



def test_after_a_commit_host_folders_and_copies_keep_the_steps_run_dir_keeps(tmp_path):
    from flowrl.runtime.controller.shards import prune_shards
    from flowrl.runtime.launch.launcher import SubprocessLauncher

    run_dir, b_run, bucket = tmp_path / "run", tmp_path / "b" / "run", tmp_path / "bucket" / "run"
    for step in (5, 10):
        (run_dir / "checkpoints" / f"step{step:08d}").mkdir(parents=True)
        (run_dir / "checkpoints" / f"step{step:08d}" / "commit.json").write_text("{}")
    for root in (b_run, bucket):
        for step in (0, 3, 5, 10, 15):  # 3: a partial save never committed; 15: being written now
            (root / "checkpoints" / f"step{step:08d}").mkdir(parents=True)
    record = {"step": 10, "shards": {"actor/0/0": {"file": "step00000010/actor.0.0.e0.pt", "host": "host-b",
                                                   "folder": str(b_run),
                                                   "copy": str(bucket / "checkpoints/step00000010/actor.0.0.e0.pt")}}}
    prune_shards(SimpleNamespace(committed=record, root=run_dir / "checkpoints"), SubprocessLauncher(), run_dir)
    for root in (b_run, bucket):
        assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["step00000005", "step00000010",
                                                                           "step00000015"]
