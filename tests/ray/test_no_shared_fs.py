"""No shared filesystem between hosts (`launcher.host_dirs`, docs/multi-host.md).

- The fetch path (controller/shards.py, RayLauncher.fetch_checkpoint) on a real two-node Ray cluster on loopback: a checkpoint shard in host-b's
  folder is copied to host-a's folder by tasks pinned to each node, its sha256 checked; a wrong
  digest and a holder that is not in the cluster give a clear error naming the holder, the file
  and the digest.
- graphs/ppo.yaml on two hosts in a network namespace (tests/ray/two_hosts.py, scenario "nofs"),
  host-b's run folder elsewhere than RUN_DIR, the trainers on host-b: their logs, pid files and
  shards stay in host-b's folder; latest.json names each shard's host and sha256; kill -9 of the
  controller, then `flowrl run --resume RUN_DIR` (the actor planned on host-a) ends exactly once:
  the actor's shard fetched from host-b, the critic's read on host-b.
- The same with `launcher.checkpoint_uri`, host-b and its folder lost at step 10: actor and critic
  move to host-a and start from the copies there.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from flowrl.runtime.protocol.checkpoints import CheckpointError, file_digest
from tests.runtime.test_shards import Events, shard_setup

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
def test_a_shard_is_fetched_from_its_holder_host_through_ray_digest_checked(ray_cluster, tmp_path):
    from flowrl.ray_cluster import RayCluster
    from flowrl.runtime.controller.shards import ensure_shard
    from flowrl.runtime.launch.ray_launcher import RayLauncher

    cluster, _ = ray_cluster
    launcher = RayLauncher(cluster=RayCluster(cluster.address, owned=False, joined=False))
    payload = b"\x00checkpoint bytes\xff" * 5000
    a_dir, b_dir, name, digest, record = shard_setup(tmp_path, payload)
    dst = a_dir / "checkpoints" / name
    spec = SimpleNamespace(proc_id="actor/0/0", host="host-a", home=str(a_dir), resume_from=str(dst))
    book, ledger = SimpleNamespace(committed=record), Events()
    host_dirs = {"host-b": str(tmp_path / "b")}

    ensure_shard(book, spec, launcher, host_dirs, ledger)  # host-b's folder -> host-a's, through Ray tasks
    assert dst.read_bytes() == payload and file_digest(dst) == (digest, len(payload))
    assert [(r.proc, r.holder, r.host, r.fetched, r.sha256) for r in ledger.rows] == [
        ("actor/0/0", "host-b", "host-a", True, digest)]
    assert not list(dst.parent.glob("*.tmp"))
    # there already with the right digest: nothing copied
    assert launcher.fetch_checkpoint(src_host="host-b", src=str(b_dir / "checkpoints" / name), dst_host="host-a",
                                     dst=str(dst), sha256=digest) == "present"
    # on its own host, in its own folder: read there, nothing to fetch
    home_b = SimpleNamespace(proc_id="actor/0/0", host="host-b", home=str(b_dir),
                             resume_from=str(b_dir / "checkpoints" / name))
    ensure_shard(book, home_b, launcher, host_dirs, ledger)
    assert ledger.rows[-1].fetched is False and ledger.rows[-1].host == "host-b"

    # the holder's file changed since the commit: refused, the target left without it
    dst.unlink()
    (b_dir / "checkpoints" / name).write_bytes(payload + b"tampered")
    with pytest.raises(CheckpointError) as e:
        ensure_shard(book, spec, launcher, host_dirs, ledger)
    text = str(e.value)
    assert "held by host 'host-b'" in text and name in text and digest in text and "not the committed" in text
    assert not dst.exists() and not list(dst.parent.glob("*.tmp"))

    # the holder is not in the cluster: the run cannot go on, and says how to fix it
    gone = {**record, "shards": {"actor/0/0": {**record["shards"]["actor/0/0"], "host": "host-z"}}}
    with pytest.raises(CheckpointError) as e:
        ensure_shard(SimpleNamespace(committed=gone), spec, launcher, {**host_dirs, "host-z": "/nowhere"}, ledger)
    text = str(e.value)
    assert "Ray node 'host-z'" in text and "not in the cluster" in text and name in text and digest in text
    assert "launcher.host_dirs" in text and "--resume" in text and "checkpoint_uri" in text
    # ... unless the shard has its copy under launcher.checkpoint_uri: the target reads that one
    copy = tmp_path / "bucket" / "run" / "checkpoints" / name
    copy.parent.mkdir(parents=True)
    copy.write_bytes(payload)
    gone["shards"]["actor/0/0"]["copy"] = str(copy)
    ensure_shard(SimpleNamespace(committed=gone), spec, launcher, {**host_dirs, "host-z": "/nowhere"}, ledger)
    assert dst.read_bytes() == payload
    assert (ledger.rows[-1].holder, ledger.rows[-1].fetched) == ("checkpoint_uri", True)
    dst.unlink()
    copy.write_bytes(b"not it")
    with pytest.raises(CheckpointError) as e:
        ensure_shard(SimpleNamespace(committed=gone), spec, launcher, {**host_dirs, "host-z": "/nowhere"}, ledger)
    assert f"nor from its copy {copy}" in str(e.value) and "not the committed" in str(e.value) and not dst.exists()


STEPS = 25
HOST_OF = {"actor": "host-b", "critic": "host-b", "reference": "host-a",
           "prompts": "host-a", "rollout": "host-a", "reward": "host-a"}


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_ppo_with_host_b_in_its_own_folder_checkpoints_there_and_resumes_after_kill_9_of_the_controller(tmp_path):
    """Actor and critic on host-b (own folder); kill -9 of the controller after the checkpoint at
    step >= 10; `--resume` plans the actor on host-a: its shard is fetched from host-b, the
    critic's is read where it is."""
    from tests.ray.test_two_hosts import run_scenario

    host_b = tmp_path / "host-b-disk"
    run_dir = tmp_path / "run"
    hosts = [f"nodes.{node}.host={host}" for node, host in HOST_OF.items()]
    facts = run_scenario(tmp_path, {
        "nofs": True, "graph": str(ROOT / "graphs" / "ppo.yaml"), "host_b_run": str(host_b / "run"),
        "overrides": ["launcher.type=ray", f"schedule.steps={STEPS}", "schedule.checkpoint_every=5",
                      f"launcher.host_dirs.host-b={host_b}", *hosts],
        "resume_overrides": ["nodes.actor.host=host-a"],
        "processes": 6, "timeout_s": 200, "kill_controller_at": 10}, timeout_s=400)
    assert facts["hosts"] == {f"{n}.0.0": h for n, h in HOST_OF.items()}
    assert facts["first_rc"] == -9 and facts["checkpoint_before"] >= 10
    assert facts["rc"] == 0, facts["stderr"]
    on_b, on_a = {"actor.0.0", "critic.0.0"}, {f"{n}.0.0" for n, h in HOST_OF.items() if h == "host-a"}
    # host-b's processes keep their logs, pid files and shards in host-b's folder, none in RUN_DIR
    b, a = facts["before_resume"]["host_b"], facts["before_resume"]["run_dir"]
    assert set(b["logs"]) == {f"logs/{n}.log" for n in on_b} and set(a["logs"]) == {f"logs/{n}.log" for n in on_a}
    assert set(b["pids"]) == {f"procs/{n}.pid" for n in on_b} and set(a["pids"]) == {f"procs/{n}.pid" for n in on_a}
    assert b["shards"] and {Path(s).name.split(".e")[0] for s in b["shards"]} == on_b
    assert a["shards"] == []
    # after the resume the actor runs on host-a (RUN_DIR), the critic still on host-b; pid files gone at the end
    b, a = facts["host_b"], facts["run_dir"]
    assert set(a["logs"]) == {f"logs/{n}.log" for n in on_a | {"actor.0.0"}} and a["pids"] == []
    assert set(b["pids"]) <= {"procs/actor.0.0.pid"}  # at most the one the controller's kill -9 left
    assert {Path(s).name.split(".e")[0] for s in a["shards"]} == {"actor.0.0"}
    # old steps are pruned in host-b's folder as in RUN_DIR (keep_checkpoints: 2), the moved actor's too
    assert b["shards"] == ["checkpoints/step00000020/critic.0.0.e1.pt", "checkpoints/step00000025/critic.0.0.e1.pt"]
    assert {s.split("/")[1] for s in a["shards"]} == {"step00000020", "step00000025"}
    # the commit record (on the controller's host only) names each shard's host, folder and digest
    assert (run_dir / "checkpoints" / "latest.json").exists() and not (host_b / "run" / "checkpoints").joinpath(
        "latest.json").exists()
    record = facts["latest"]
    assert record["step"] == STEPS
    shards = record["shards"]
    assert {p: (s["host"], s["folder"]) for p, s in shards.items()} == {
        "actor/0/0": ("host-a", str(run_dir)), "critic/0/0": ("host-b", str(host_b / "run"))}
    for proc, shard in shards.items():
        assert shard["sha256"] == facts["digests"][proc] and len(shard["sha256"]) == 64
        assert shard["size"] == (Path(shard["folder"]) / "checkpoints" / shard["file"]).stat().st_size
    # the resume fetched the actor's shard from host-b, read the critic's on host-b; exactly once, no restarts
    resumed = facts["events"]["resumed"]
    assert len(resumed) == 1 and resumed[0]["step"] >= 10
    assert sorted((r["proc"], r["host"], r["holder"], r["fetched"]) for r in facts["events"]["shard"]) == [
        ("actor/0/0", "host-a", "host-b", True), ("critic/0/0", "host-b", "host-b", False)]
    assert facts["events"]["node_down"] == [] and facts["events"]["recovery"] == []
    assert facts["audit"] == {"exactly_once": True, "issued": STEPS, "lost": [], "duplicated": []}
    rewards = facts["rewards"]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:3]) / 3 + 0.1, [round(r, 2) for r in rewards]  # it learns a bit
    assert facts["left_alive"] == []


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_losing_the_trainers_host_and_its_folder_restores_their_shards_from_the_checkpoint_uri_copies(tmp_path):
    """Actor and critic on host-b (own folder), each shard also copied to `launcher.checkpoint_uri`;
    host-b leaves the cluster and its folder is deleted after the checkpoint at step >= 10: both
    move to host-a and start from the copies, digests checked; the run ends exactly once."""
    from tests.ray.test_two_hosts import run_scenario

    host_b, bucket, run_dir = tmp_path / "host-b-disk", tmp_path / "bucket", tmp_path / "run"
    hosts = [f"nodes.{node}.host={host}" for node, host in HOST_OF.items()]
    facts = run_scenario(tmp_path, {
        "nofs": True, "graph": str(ROOT / "graphs" / "ppo.yaml"), "host_b_run": str(host_b / "run"),
        "overrides": ["launcher.type=ray", f"schedule.steps={STEPS}", "schedule.checkpoint_every=5",
                      f"launcher.host_dirs.host-b={host_b}", f"launcher.checkpoint_uri={bucket}", *hosts],
        "processes": 6, "timeout_s": 200, "remove_at_checkpoint": 10}, timeout_s=400)
    assert facts["hosts"] == {f"{n}.0.0": h for n, h in HOST_OF.items()}
    assert facts["rc"] == 0, facts["stderr"]
    assert facts["before"]["run_dir"]["shards"] == [] and facts["before"]["host_b"]["shards"]
    assert not (host_b / "run").exists()
    assert facts["events"]["replanned"][0]["moved"] == {"actor/0/0": "host-a", "critic/0/0": "host-a"}
    assert facts["events"]["recovery"], "moving the trainers rolls every stateful node back"
    placed = sorted((r["proc"], r["host"], r["holder"], r["fetched"]) for r in facts["events"]["shard"])
    assert placed == [("actor/0/0", "host-a", "checkpoint_uri", True), ("critic/0/0", "host-a", "checkpoint_uri", True)]
    record = facts["latest"]
    assert record["step"] == STEPS
    for proc, shard in record["shards"].items():  # after the move: on host-a, in RUN_DIR, and copied again
        assert (shard["host"], shard["folder"]) == ("host-a", str(run_dir))
        assert shard["sha256"] == facts["digests"][proc]
        assert shard["copy"] == str(bucket / "run" / "checkpoints" / shard["file"])
        assert file_digest(Path(shard["copy"]))[0] == shard["sha256"]
    assert sorted(p.name for p in (bucket / "run" / "checkpoints").iterdir()) == ["step00000020", "step00000025"]
    assert facts["audit"] == {"exactly_once": True, "issued": STEPS, "lost": [], "duplicated": []}
    assert facts["left_alive"] == []

