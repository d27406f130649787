"""Checkpoint files: a node's state as tensors and plain data, written atomically, read safely.

    RUN_DIR/checkpoints/step00000025/actor.0.0.e1.pt     one file per stateful node process
    RUN_DIR/checkpoints/latest.json                      the last committed consistent checkpoint

A process on a host listed in `launcher.host_dirs` writes its shard under its host's folder
instead (`FOLDER/<run name>/checkpoints/...`); the commit record (`latest.json`, `commit.json`)
stays with the controller and names, per process, its file, sha256, size, host and folder
(`shards`), so a shard can be fetched to wherever its process starts next (controller/shards.py).

A file is `torch.save({"node": state_dict, "step", "epoch", "version"})`, written to a temp file,
fsynced and renamed, and loaded with `torch.load(weights_only=True)`: tensors, numbers, strings,
lists and dicts only — never pickled code, so a checkpoint someone else wrote cannot run anything.
Every path read from `latest.json` must stay inside `RUN_DIR/checkpoints` (`confine`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from flowrl.errors import FlowrlError


class CheckpointError(FlowrlError, ValueError):
    """A checkpoint that cannot be used: missing, outside the run directory, or not plain data."""


def step_dir(step: int) -> str:
    return f"step{step:08d}"


def file_name(log_name: str, step: int, epoch: int) -> str:
    """Path relative to RUN_DIR/checkpoints of one process's state at `step` in `epoch`."""
    return f"{step_dir(step)}/{log_name}.e{epoch}.pt"


def confine(root: Path, relative: Any) -> Path:
    """`root / relative`, refusing anything that is not a plain relative path inside `root`."""
    if type(relative) is not str or not relative or "\x00" in relative:
        raise CheckpointError(f"checkpoint path {relative!r:.100} is not a relative file name")
    root = Path(root).resolve()
    path = (root / relative).resolve()
    if Path(relative).is_absolute() or root not in path.parents:
        raise CheckpointError(f"checkpoint path {relative!r:.100} points outside {root}; "
                              "latest.json was edited or comes from elsewhere")
    return path


def host_folder(run_dir: str | Path, host_dirs: dict, host: str | None) -> Path:
    """Where a process on `host` keeps its files: `FOLDER/<run directory's name>` for a host listed
    in `launcher.host_dirs`, else the run directory itself (shared)."""
    run_dir = Path(run_dir)
    return Path(host_dirs[host]) / run_dir.absolute().name if host in host_dirs else run_dir


def file_digest(path: Path) -> tuple[str, int]:
    """(sha256 hex, size in bytes) of a file."""
    import hashlib

    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def copy_file(src: Path, dst: Path) -> Path:
    """Copy `src` to `dst` whole or not at all (temp file, fsync, rename)."""
    import shutil

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f"{dst.name}.{os.getpid()}.tmp")
    with open(src, "rb") as f, open(tmp, "wb") as g:
        shutil.copyfileobj(f, g, 1 << 20)
        g.flush()
        os.fsync(g.fileno())
    os.replace(tmp, dst)
    fsync_dir(dst.parent)
    return dst


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_state(path: Path, state: dict, *, step: int, epoch: int, version: int) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save({"node": state, "step": step, "epoch": epoch, "version": version}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def load_state(path: Path) -> dict:
    import pickle

    import torch

    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        raise CheckpointError(f"checkpoint file {path} is not a plain-data checkpoint (tensors, numbers, "
                              f"strings, lists, dicts): {str(e).splitlines()[0][:200]}") from None
    if not isinstance(data, dict) or "node" not in data:
        raise CheckpointError(f"checkpoint file {path} does not hold a node state")
    return data


def write_json_atomic(path: Path, record: dict, mode: int = 0o644) -> None:
    """Write `record` whole or not at all (a reader never sees half a file), created with `mode`
    (0600 for a file with a secret in it: never readable by others, not even for a moment)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)  # a leftover of a killed writer keeps its mode: start afresh
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_latest(run_dir: Path) -> dict:
    """The committed checkpoint record of a run directory, its file names checked."""
    latest = Path(run_dir) / "checkpoints" / "latest.json"
    try:
        record = json.loads(latest.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint to resume from ({latest} is missing); a run writes one "
                              "every schedule.checkpoint_every steps and at its end") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{latest} is not valid JSON ({e})") from None
    if not isinstance(record, dict) or type(record.get("step")) is not int or not isinstance(record.get("files"), dict):
        raise CheckpointError(f"{latest} is not a flowrl checkpoint record (needs step and files)")
    root = Path(run_dir) / "checkpoints"
    for proc, name in record["files"].items():
        confine(root, name)
    return record


def node_checkpoint(run_dir: Path, node: str, step: int | None = None, replica: int = 0, rank: int = 0) -> dict:
    """The saved checkpoint of `node` ({"node": state_dict, "step", "epoch", "version"}) at the
    committed checkpoint, or at an older committed `step` that is still kept."""
    root = Path(run_dir) / "checkpoints"
    record = read_latest(run_dir)
    if step is not None and step != record["step"]:
        try:
            record = json.loads((root / step_dir(step) / "commit.json").read_text())
        except (FileNotFoundError, ValueError):
            kept = sorted(p.name for p in root.glob("step*") if (p / "commit.json").exists())
            raise CheckpointError(f"no committed checkpoint at step {step}; kept: {', '.join(kept) or 'none'}") from None
    proc = f"{node}/{replica}/{rank}"
    name = record["files"].get(proc)
    if name is None:
        raise CheckpointError(f"the checkpoint at step {record['step']} has no state of {proc} "
                              f"(it has {', '.join(record['files']) or 'none'})")
    path = confine(root, name)
    shard = (record.get("shards") or {}).get(proc) or {}
    if not path.exists() and shard.get("folder"):  # kept in its host's folder (launcher.host_dirs)
        path = confine(Path(shard["folder"]) / "checkpoints", name)
    return load_state(path)


def node_state(run_dir: Path, node: str, step: int | None = None, replica: int = 0, rank: int = 0) -> dict:
    """The saved state_dict of `node` (see `node_checkpoint`)."""
    return node_checkpoint(run_dir, node, step, replica, rank)["node"]
