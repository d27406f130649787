"""A sink that remembers which dataset rows it trained on (checkpointed like a trainer's state)."""

import json
import time

import flowrl


class SeenRows(flowrl.Sink):
    stateful = True

    class Config(flowrl.NodeConfig):
        seconds: float = 0.0
        """Time each batch takes (a trainer's update), so a test can stop the run midway."""

    async def setup(self):
        self.seen: list[int] = []

    async def process(self, batch, port):
        time.sleep(self.config.seconds)  # blocking on purpose: a trainer computing
        self.seen.extend(int(r) for r in batch.tensors["rows"].tolist())
        self.ctx.recorder.count("samples", batch.num_samples)

    def state_dict(self):
        return {"seen": list(self.seen)}

    def load_state_dict(self, state):
        self.seen = list(state["seen"])

    async def teardown(self):
        (self.ctx.run_dir / "seen_rows.json").write_text(json.dumps(self.seen))
