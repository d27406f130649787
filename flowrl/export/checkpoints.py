"""Read a node's state out of a run directory's checkpoints: the ONE place that knows their format.

    state = load_checkpoint_state("runs/grpo-math-...", "actor")            # the last committed step
    state = load_checkpoint_state("runs/grpo-math-...", "actor", step=50)   # a chosen one
    state["model"]                                                         # the actor's weights

Format read here: ``RUN_DIR/checkpoints/latest.json`` lists the committed step and, under
``files``, one file per process (``{"actor/0/0": "actor.0.0.step000150.pt"}``, relative to
``checkpoints/``); each file holds ``{"node": node.state_dict(), "applied", "version", "step"}``.
Older steps are found by file name (``NODE.REPLICA.RANK.stepNNNNNN.pt``). Files that hold only
tensors and plain data load with ``weights_only=True``; older pickled ones are loaded in full
(they are files this run wrote).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any


class CheckpointError(FileNotFoundError):
    """No usable checkpoint; the message says what exists and how to get one."""


def checkpoint_path(run_dir: str | Path, node: str, step: int | None = None) -> tuple[Path, int]:
    """The file holding replica 0 / rank 0 of ``node`` at ``step`` (default: the last committed) and that step."""
    ckpts = Path(run_dir) / "checkpoints"
    latest = ckpts / "latest.json"
    if step is None:
        if not latest.exists():
            raise CheckpointError(f"{latest} does not exist: the run committed no checkpoint (a run writes one at its "
                                  "end and every schedule.checkpoint_every steps)")
        record = json.loads(latest.read_text())
        files = record.get("files", {})
        mine = sorted(pid for pid in files if pid.split("/")[0] == node)
        if not mine:
            raise CheckpointError(f"the checkpoint of step {record.get('step')} has no files of node {node!r} "
                                  f"(it has {sorted({p.split('/')[0] for p in files})}); pass --node")
        return ckpts / files[mine[0]], int(record.get("step", 0))
    pattern = re.compile(rf"^{re.escape(node)}\.(\d+)\.(\d+)\.step{step:06d}\.pt$")
    found = sorted((p for p in ckpts.glob(f"{node}.*.step{step:06d}.pt") if pattern.match(p.name)), key=lambda p: p.name)
    if not found:
        have = sorted({int(m.group(1)) for p in ckpts.glob(f"{node}.*.pt")
                       if (m := re.search(r"step(\d+)\.pt$", p.name))})
        raise CheckpointError(f"no checkpoint of node {node!r} at step {step} in {ckpts}; steps on disk: {have or 'none'}")
    return found[0], step


def load_checkpoint_state(run_dir: str | Path, node: str, step: int | None = None) -> dict[str, Any]:
    """``node.state_dict()`` as saved in the checkpoint of ``step`` (default: the last committed)."""
    import pickle

    import torch

    path, _ = checkpoint_path(run_dir, node, step)
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError):
        data = torch.load(path, map_location="cpu", weights_only=False)
    return data["node"] if isinstance(data, dict) and "node" in data else data
