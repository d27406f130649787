"""No shared filesystem between hosts (`launcher.host_dirs`, docs/multi-host.md).

- The fetch path (controller/shards.py, RayLauncher.fetch_checkpoint) on a real two-node Ray cluster on loopback: a checkpoint shard in host-b's
  folder is copied to host-a's folder by tasks pinned to each node, its sha256 checked; a wrong
  digest and a holder that is not in the cluster give a clear error naming the holder, the file
  and the digest.
- graphs/ppo.yaml on two hosts in a network namespace (tests/ray/two_hosts.py), host-b's run
  folder elsewhere than RUN_DIR, the trainers (stateful, and the weights' publisher) on host-b,
  each shard also copied to `launcher.checkpoint_uri`: host-b and its folder are lost after the
  checkpoint at step >= 10; actor and critic move to host-a, start from the copies, every stateful
  node rolls back, the weight store moves with the actor, and the run ends exactly once with
  every version published. (Checkpoints on both hosts with an actor whose ranks span them, kill
  -9 of the controller and `--resume`: tests/ray/test_two_hosts.py.)
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
@pytest.mark.timeout(300)
def test_losing_the_trainers_host_and_its_folder_moves_them_restores_their_shards_from_the_copies_and_the_weights_follow(tmp_path):
    """Actor and critic on host-b (own folder), each shard also copied to `launcher.checkpoint_uri`;
    host-b leaves the cluster and its folder is deleted after the checkpoint at step >= 10: both
    move to host-a and start from the copies, digests checked; the run ends exactly once."""
    from tests.ray.test_two_hosts import run_scenario

    host_b, bucket, run_dir = tmp_path / "host-b-disk", tmp_path / "bucket", tmp_path / "run"
    hosts = [f"nodes.{node}.host={host}" for node, host in HOST_OF.items()]
    facts = run_scenario(tmp_path, {
        "graph": str(ROOT / "graphs" / "ppo.yaml"), "host_b_run": str(host_b / "run"), "probe": False,
        "overrides": ["launcher.type=ray", f"schedule.steps={STEPS}", "schedule.checkpoint_every=5",
                      f"launcher.host_dirs.host-b={host_b}", f"launcher.checkpoint_uri={bucket}", *hosts],
        "processes": 6, "timeout_s": 200, "remove_at_checkpoint": 10, "remove_folder": True}, timeout_s=280)
    assert facts["hosts"] == {f"{n}.0.0": h for n, h in HOST_OF.items()}
    assert facts["rc"] == 0, facts["stderr"]
    assert facts["specs"]["actor.0.0"]["host_address"] == "127.0.0.2"
    assert facts["specs"]["critic.0.0"]["inputs"]["in"].startswith("tcp://127.0.0.2:")  # fed by reference on host-a
    before = facts["before_removal"]
    assert before["run_dir"]["shards"] == [] and before["host_b"]["shards"]
    assert {Path(s).name.split(".e")[0] for s in before["host_b"]["shards"]} == {"actor.0.0", "critic.0.0"}
    assert set(before["host_b"]["logs"]) == {"logs/actor.0.0.log", "logs/critic.0.0.log"}
    assert not (host_b / "run").exists()
    events = facts["events"]
    assert [r["moved"] for r in events["replanned"]] == [{"actor/0/0": "host-a", "critic/0/0": "host-a"}]
    assert len(events["recovery"]) == 1, ("moving the trainers rolls every stateful node back, once: both "
                                          f"went down with their host ({events['recovery']})")
    assert set(facts["hosts_after"].values()) == {"host-a"}
    placed = sorted((r["proc"], r["host"], r["holder"], r["fetched"]) for r in events["shard"])
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
    assert facts["versions"][-1] == STEPS - 1  # the moved actor published every version, the rollout took them
    assert facts["left_alive"] == [] and facts["cluster_released"] is True and facts["sockdirs_left"] == []
