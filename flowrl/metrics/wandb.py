"""Weights & Biases sink, offline by default: a run folder under RUN_DIR/wandb/, no network.

    wandb sync RUN_DIR/wandb/offline-run-*        # upload later, from a machine that may

`mode: offline` sets WANDB_MODE=offline before wandb is imported, so nothing is sent at run time.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from flowrl.metrics.sink import MetricSink, numeric


class WandbSink(MetricSink):
    def __init__(self, run_dir: str | Path, *, project: str = "flowrl", mode: str = "offline", name: str | None = None):
        if mode == "offline":
            os.environ["WANDB_MODE"] = "offline"
        os.environ.setdefault("WANDB_SILENT", "true")
        try:
            import wandb
        except ImportError:
            raise ImportError("metrics.wandb needs the wandb package: pip install 'flowrl[logging]'") from None
        self.wandb = wandb
        self.run = wandb.init(project=project, name=name, dir=str(run_dir), mode=mode,
                              settings=wandb.Settings(silent=True, console="off"))

    def write(self, row: dict[str, Any]) -> None:
        self.run.log(numeric(row), step=int(row["step"]))

    def close(self) -> None:
        self.run.finish()
