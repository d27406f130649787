"""A stateful process that starts where its checkpoint shard is not gets the shard first.

Without a shared run directory (`launcher.host_dirs`), each process writes its shard into its own
host's folder, and the commit record (`RUN_DIR/checkpoints/latest.json`, kept by the controller)
names per process its file, sha256, size, host and folder there (`shards`). When the process
starts again on another host (its host was lost and it was re-planned; `--resume` planned it
elsewhere), the controller has the launcher copy the shard from the host that holds it before the
process starts (`launcher.fetch_checkpoint`: under Ray a task pinned to the holder reads it, one
pinned to the target writes it atomically after checking the digest). A holder that is gone fails
the run naming it, the file and how to fix it.

    ensure_shard(book, proc.spec, launcher, host_dirs, ledger)   # before the launcher starts it
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
    committed checkpoint). Raises CheckpointError, naming the holder, file and digest, when the
    shard cannot be brought there."""
    committed = book.committed
    shard = ((committed or {}).get("shards") or {}).get(ps.proc_id)
    if not ps.resume_from or not shard or not shard.get("folder"):
        return  # nothing committed, or a record without shard facts (older runs: a shared folder)
    fetched = needs_fetch(shard, ps.host, ps.home, host_dirs)
    if fetched:
        src = str(confine(Path(shard["folder"]) / "checkpoints", shard["file"]))
        try:
            how = launcher.fetch_checkpoint(src_host=shard.get("host"), src=src, dst_host=ps.host,
                                            dst=ps.resume_from, sha256=shard["sha256"], size=shard.get("size"))
        except CheckpointError as e:
            raise CheckpointError(
                f"{ps.proc_id} cannot start on host {ps.host!r}: its checkpoint shard {shard['file']} (step "
                f"{committed['step']}, sha256 {shard['sha256']}, {shard.get('size')} bytes) is held by host "
                f"{shard.get('host')!r} at {src}, and {e}. Fix: bring host {shard.get('host')!r} back (same "
                "folder) and `flowrl run --resume RUN_DIR`, or keep the run directory on a filesystem every host "
                "shares (leave that host out of launcher.host_dirs)") from None
        fetched = how != "present"
    if fetched or host_dirs:
        ledger.record(ShardPlaced(proc=ps.proc_id, file=shard["file"], host=str(ps.host), holder=str(shard.get("host")),
                                  fetched=fetched, sha256=shard["sha256"]))
