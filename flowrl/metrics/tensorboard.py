"""TensorBoard sink: every numeric column of a row as a scalar, at the row's step.

    tensorboard --logdir RUN_DIR/tensorboard

Uses only the `tensorboard` package's event-file writer (no torch, no TensorFlow). Keys keep
their metrics.jsonl names, so `eval/reward_greedy` and `actor/busy_ratio` group by prefix.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from flowrl.metrics.sink import MetricSink, numeric


class TensorBoardSink(MetricSink):
    def __init__(self, logdir: str | Path):
        try:
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            raise ImportError("metrics.tensorboard needs the tensorboard package: pip install 'flowrl[logging]'") from None
        self._event, self._summary = Event, Summary
        Path(logdir).mkdir(parents=True, exist_ok=True)
        self.writer = EventFileWriter(str(logdir))

    def write(self, row: dict[str, Any]) -> None:
        values = [self._summary.Value(tag=k, simple_value=v) for k, v in numeric(row).items()]
        self.writer.add_event(self._event(wall_time=time.time(), step=int(row["step"]),
                                          summary=self._summary(value=values)))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
