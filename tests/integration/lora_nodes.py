"""A rollout that keeps sampling its own frozen weights (it takes no weight versions): in
tests/integration/test_lora_graph.py it feeds a LoRA actor while the adapter sync lives elsewhere."""

from flowrl.nodes.rollout import Rollout


class BaseRollout(Rollout):
    subscribes_weights = False
