"""Read a node's state out of a run directory's checkpoints (the runtime's reader, see
`flowrl/runtime/protocol/checkpoints.py`, which knows their format).

    state = load_checkpoint_state("runs/grpo-math-...", "actor")            # the last committed step
    state = load_checkpoint_state("runs/grpo-math-...", "actor", step=50)   # a kept older one
    state["model"]                                                         # the actor's weights

Files hold tensors and plain data only and load with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flowrl.runtime.protocol.checkpoints import CheckpointError as _RuntimeCheckpointError
from flowrl.runtime.protocol.checkpoints import node_state, read_latest


class CheckpointError(FileNotFoundError):
    """No usable checkpoint; the message says what exists and how to get one."""


def checkpoint_path(run_dir: str | Path, node: str, step: int | None = None) -> tuple[Path, int]:
    """The file holding replica 0 / rank 0 of `node` at the committed step, and that step."""
    try:
        record = read_latest(Path(run_dir))
    except _RuntimeCheckpointError as e:
        raise CheckpointError(str(e).replace("no checkpoint to resume from", "the run committed no checkpoint")) from None
    name = record["files"].get(f"{node}/0/0")
    if name is None:
        raise CheckpointError(f"the checkpoint of step {record['step']} has no files of node {node!r} "
                              f"(it has {sorted({p.split('/')[0] for p in record['files']})}); pass --node")
    return Path(run_dir) / "checkpoints" / name, record["step"]


def load_checkpoint_state(run_dir: str | Path, node: str, step: int | None = None, *,
                          rank: int = 0) -> dict[str, Any]:
    """`node.state_dict()` as saved in the checkpoint of `step` (default: the last committed), of
    replica 0's rank `rank` (a data-parallel node saves one file per rank)."""
    checkpoint_path(run_dir, node)  # the clear errors for a run without a checkpoint of `node`
    try:
        return node_state(Path(run_dir), node, step, rank=rank)
    except _RuntimeCheckpointError as e:
        raise CheckpointError(str(e)) from None
