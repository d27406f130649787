"""The rollout on a continuous engine: several `process` calls share the engine's batch, a version
landing mid-flight is recorded per token, a batch is as stale as its oldest token, and the engine's
occupancy reaches the metrics."""

from __future__ import annotations

import asyncio

import pytest
import torch

import flowrl
from flowrl.models import build_model
from flowrl.nodes.rollout import Rollout
from tests.node_harness import make_node, metrics_row

MODEL = {"type": "tiny", "d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 48}

pytestmark = pytest.mark.timeout(60)


def prompts_batch(index: int) -> flowrl.Batch:
    prompts = flowrl.Ragged.from_sequences([[1, 2, 3, 4, 5, 6, 7], [8, 9], [3, 4, 5, 6]], dtype="int64")
    return flowrl.Batch(tensors={"prompts": prompts, "targets": torch.zeros(3, 2, dtype=torch.int64)},
                        meta={"max_new_tokens": 20}, index=index)


def test_concurrent_calls_share_the_engine_and_a_batch_is_as_old_as_its_oldest_token(tmp_path):
    config = {"model": MODEL, "samples_per_prompt": 2, "on_new_weights": "keep",
              "engine": {"type": "builtin", "continuous": True, "max_num_seqs": 4}}
    node = make_node(Rollout, config, name="rollout")
    assert node.engine.on_new_weights == "keep" and node.engine.continuous
    batcher = node.engine.batcher
    three = asyncio.Event()
    inner = batcher._iterate

    def counted():  # the third iteration announces that a version may land
        inner()
        counted.n += 1
        if counted.n == 3:
            three.set()

    counted.n = 0
    batcher._iterate = counted

    async def main():
        calls = [asyncio.create_task(node.process(prompts_batch(i), "in")) for i in range(2)]
        await three.wait()
        await node.before_weights(1)  # what the runtime does: announce, write the tensors, load
        new = build_model(MODEL, seed=5).state_dict()
        live = node.weights()
        for name, tensor in new.items():
            live[name].copy_(tensor)
        node.ctx.policy_version = 1
        node.load_weights(new, 1)
        return await asyncio.gather(*calls)

    outs = asyncio.run(asyncio.wait_for(main(), 30))
    for out in outs:
        versions, mask = out.tensors["versions"], out.tensors["loss_mask"]
        assert versions.aligned(out.tensors["tokens"]) and (versions.values[~mask.values] == -1).all()
        generated = versions.values[mask.values]
        assert out.policy_version == int(generated.min())
    seen = torch.cat([out.tensors["versions"].values for out in outs])
    assert {0, 1} <= set(seen.tolist())  # the first sequences began on version 0 and went on with 1
    assert min(out.policy_version for out in outs) == 0
    row = metrics_row(node, tmp_path)
    assert {"engine_running", "engine_waiting", "rollout_busy", "weight_pause_s"} <= set(row)
    assert row["rollout_tokens_generated"] == sum(int(o.tensors["loss_mask"].values.sum()) for o in outs)
    assert 0 <= row["rollout_busy"] <= 1


def test_a_batch_engine_stamps_every_token_with_the_version_the_node_holds():
    node = make_node(Rollout, {"model": MODEL, "samples_per_prompt": 2}, name="rollout")
    node.ctx.policy_version = 7
    out = asyncio.run(node.process(prompts_batch(0), "in"))
    versions, mask = out.tensors["versions"], out.tensors["loss_mask"]
    assert out.policy_version == 7 and set(versions.values[mask.values].tolist()) == {7}
    assert node.engine.on_new_weights == "finish"
