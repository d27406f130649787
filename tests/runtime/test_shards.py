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


@pytest.mark.timeout(200)
def test_a_local_run_with_its_own_folder_commits_digests_and_a_resume_without_it_copies_the_shards(tmp_path):
    """graphs/ppo.yaml under the local launcher with `launcher.host_dirs.localhost`: the node
    processes' logs and shards are in that folder, the record names them; `--resume` with the
    folder dropped from the graph copies each shard into RUN_DIR (digest checked) and goes on
    exactly once."""
    import json

    from flowrl.runtime.protocol.checkpoints import file_digest, node_state
    from flowrl.testing.harness import run_graph

    root = Path(__file__).resolve().parents[2]
    run_dir, disk = tmp_path / "run", tmp_path / "disk"
    first = run_graph(root / "graphs" / "ppo.yaml", run_dir, overrides=[
        "schedule.steps=8", "schedule.checkpoint_every=4", f"launcher.host_dirs.localhost={disk}"], timeout_s=150)
    assert first.exit_code == 0, first.stderr[-2000:]
    own = disk / "run"
    nodes = ("actor", "critic", "prompts", "reference", "reward", "rollout")
    assert sorted(p.name for p in (own / "logs").iterdir()) == [f"{n}.0.0.log" for n in nodes]
    assert not list((run_dir / "logs").iterdir()) and not list((run_dir / "checkpoints").glob("step*/*.pt"))
    record = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    assert record["step"] == 8 and set(record["shards"]) == {"actor/0/0", "critic/0/0"}
    for proc, shard in record["shards"].items():
        path = own / "checkpoints" / shard["file"]
        assert (shard["host"], shard["folder"]) == ("localhost", str(own))
        assert file_digest(path) == (shard["sha256"], shard["size"])
    assert node_state(run_dir, "actor")  # read from the folder the record names
    assert [r["event"] for r in first.ledger].count("shard") == 0  # nothing started from a checkpoint

    resumed = run_graph(None, run_dir, overrides=["launcher.host_dirs={}"],
                        extra=["--resume", str(run_dir), "--steps", "12"], timeout_s=150)
    assert resumed.exit_code == 0, resumed.stderr[-2000:]
    placed = sorted((r["proc"], r["fetched"], r["sha256"]) for r in resumed.ledger if r["event"] == "shard")
    assert placed == [(p, True, record["shards"][p]["sha256"]) for p in ("actor/0/0", "critic/0/0")]
    assert resumed.audit().exactly_once and len(resumed.audit().issued) == 12
    assert not [r for r in resumed.ledger if r["event"] == "node_down"]
    after = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    assert after["step"] == 12 and {s["folder"] for s in after["shards"].values()} == {str(run_dir.absolute())}
