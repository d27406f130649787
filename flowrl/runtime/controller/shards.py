"""A stateful process that starts where its checkpoint shard is not gets the shard first.

Without a shared run directory (`launcher.host_dirs`), each process writes its shard into its own
host's folder, and the commit record (`RUN_DIR/checkpoints/latest.json`, kept by the controller)
names per process its file, sha256, size, host and folder there (`shards`). When the process
starts again on another host (its host was lost and it was re-planned; `--resume` planned it
elsewhere), the controller has the launcher copy the shard from the host that holds it before the
process starts (`launcher.fetch_checkpoint`: under Ray a task pinned to the holder reads it, one
pinned to the target writes it atomically after checking the digest); when the holder is gone,
from its copy under `launcher.checkpoint_uri` if the run makes one. Else the run fails naming the
holder, the file and how to fix it.

    ensure_shard(book, proc.spec, launcher, host_dirs, ledger)   # before the launcher starts it
    prune_shards(book, launcher, run_dir)                        # after a commit: old steps go everywhere
"""

from __future__ import annotations

from pathlib import Path

from flowrl.runtime.protocol.checkpoints import CheckpointError, confine
from flowrl.runtime.protocol.ledger import ShardPlaced


def needs_fetch(shard: dict, host: str | None, home: str, host_dirs: dict) -> bool:
    """Whether the shard is somewhere else than `home` on `host`. Two hosts not listed in
    `host_dirs` share the run directory, so the same folder there is the same file."""
    if shard.get("folder") != str(Path(home).absolute()):
        return True
    shared = shard.get("host") not in host_dirs and host not in host_dirs
    return not (shared or shard.get("host") == host)


def ensure_shard(book, ps, launcher, host_dirs: dict, ledger) -> None:
    """Make `ps.resume_from` exist on `ps.host` (a stateful process about to start from the
    committed checkpoint): from the host that holds the shard, else from its copy under
    `launcher.checkpoint_uri`. Raises CheckpointError, naming the holder, file and digest, when the
    shard cannot be brought there."""
    committed = book.committed
    shard = ((committed or {}).get("shards") or {}).get(ps.proc_id)
    if not ps.resume_from or not shard or not shard.get("folder"):
        return  # nothing committed, or a record without shard facts (older runs: a shared folder)
    holder = str(shard.get("host"))
    fetched = needs_fetch(shard, ps.host, ps.home, host_dirs)
    if fetched:
        src = str(confine(Path(shard["folder"]) / "checkpoints", shard["file"]))
        fetch = dict(dst_host=ps.host, dst=ps.resume_from, sha256=shard["sha256"], size=shard.get("size"))
        try:
            how = launcher.fetch_checkpoint(src_host=shard.get("host"), src=src, **fetch)
        except CheckpointError as e:
            why, fix = str(e), ("bring host {h} back (same folder) and `flowrl run --resume RUN_DIR`, or set "
                                "launcher.checkpoint_uri (a folder every host reaches) or keep the run directory on a "
                                "filesystem every host shares (leave that host out of launcher.host_dirs)")
            if not shard.get("copy"):
                raise CheckpointError(unreachable(ps, shard, committed, src, why, fix)) from None
            try:  # the second copy: the target host reads it where every host can
                how = launcher.fetch_checkpoint(src_host=ps.host, src=shard["copy"], **fetch)
            except CheckpointError as e2:
                raise CheckpointError(unreachable(ps, shard, committed, src, f"{why}; nor from its copy "
                                                  f"{shard['copy']}: {e2}", fix)) from None
            holder = "checkpoint_uri"
        fetched = how != "present"
    if fetched or host_dirs:
        ledger.record(ShardPlaced(proc=ps.proc_id, file=shard["file"], host=str(ps.host), holder=holder,
                                  fetched=fetched, sha256=shard["sha256"]))


def unreachable(ps, shard: dict, committed: dict, src: str, why: str, fix: str) -> str:
    host = shard.get("host")
    return (f"{ps.proc_id} cannot start on host {ps.host!r}: its checkpoint shard {shard['file']} (step "
            f"{committed['step']}, sha256 {shard['sha256']}, {shard.get('size')} bytes) is held by host {host!r} at "
            f"{src}, and {why}. Fix: " + fix.format(h=repr(host)))


def prune_shards(book, launcher, run_dir) -> None:
    """After a commit: the host folders and the `checkpoint_uri` copies of the committed shards keep
    the same steps as RUN_DIR/checkpoints (`schedule.keep_checkpoints`; the book pruned that)."""
    record = book.committed or {}
    kept = sorted(int(d.name[4:]) for d in book.root.glob("step*") if d.name[4:].isdigit()
                  and (d / "commit.json").exists())
    here = str(Path(run_dir).absolute())
    roots = set()
    for shard in (record.get("shards") or {}).values():
        if shard.get("folder") and shard["folder"] != here:
            roots.add((shard.get("host"), str(Path(shard["folder"]) / "checkpoints")))
        if shard.get("copy"):  # URI/<run>/checkpoints/stepN/file: readable from the controller's host
            roots.add((None, str(Path(shard["copy"]).parent.parent)))
    for host, root in sorted(roots, key=str):
        launcher.prune_checkpoints(host, root, kept, record.get("step", 0))
