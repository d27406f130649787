"""What a metric sink is (sinks.py builds them; tensorboard.py and wandb.py are two)."""

from __future__ import annotations

from typing import Any


class MetricSink:
    """Base class: receives each row of metrics.jsonl as a dict."""

    def write(self, row: dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


def numeric(row: dict[str, Any]) -> dict[str, float]:
    """The row's numeric values (booleans and None left out), keyed as in metrics.jsonl."""
    return {k: float(v) for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
