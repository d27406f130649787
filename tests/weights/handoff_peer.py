"""A subscriber that takes handed-off versions, in its own process: `python -m tests.weights.handoff_peer CONFIG_JSON`
(or a publisher: `... handoff_peer pub CONFIG_JSON`).

Like `peers.subscriber` (one JSON line per op), with `handoff` on each join, and what the process
holds after each op: its staging bytes (0 when the region itself was the staging buffer).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from tests.weights.peers import master, module_of


def main(cfg: dict) -> None:
    from flowrl.weights import WeightSyncError, weights_digest
    from flowrl.weights.handoff import SharedSubscriber

    target = master(0, cfg.get("dtype", "float32"))
    if cfg.get("module"):
        target = module_of(target)
    sub = SharedSubscriber(target, bucket_bytes=cfg.get("bucket_bytes", 32 << 10), version=0)
    for op in cfg["ops"]:
        out: dict = {"op": op["op"]}
        try:
            if op["op"] == "join":
                sub.join(op["epoch"], op["rank"], op["world"], tuple(cfg["addr"]), os.environ["FLOWRL_TEST_SECRET"],
                         timeout_s=20, ready_timeout_s=20, handoff=op.get("handoff", True))
            else:
                if "fault_after" in op:
                    def fault(i, k=op["fault_after"]):
                        if i == k:
                            raise RuntimeError(f"injected fault after bucket {k}")
                    sub.fault_hook = fault
                else:
                    sub.fault_hook = None
                out["received"] = sub.receive()
        except WeightSyncError as e:
            out["error"] = f"{type(e).__name__}: {e}"
        out["version"] = sub.version
        out["digest"] = sub.digest()
        if cfg.get("module"):
            out["module_digest"] = weights_digest(target.state_dict(), sub.layout)
        out["staging_bytes"] = sum(b.numel() * b.element_size() for b in sub.staging)
        print(json.dumps(out), flush=True)
    sub.close()


def publisher(cfg: dict) -> None:
    """Serves handoff rounds of epoch 1 (versions 1, 2, ...) after printing its store address and region name."""
    from flowrl.weights.handoff import SharedPublisher

    weights = master(1)
    pub = SharedPublisher(lambda: weights, bucket_bytes=32 << 10, secret=os.environ["FLOWRL_TEST_SECRET"],
                          region_name=cfg["region_name"])
    pub.snapshot(1)
    pub.shared()
    print(json.dumps({"addr": pub.store_addr, "region": pub.region.handle["name"]}), flush=True)
    for v in range(1, cfg["rounds"] + 1):
        weights.update(master(v))
        pub.snapshot(v)
        print(json.dumps({"served": pub.serve(1, 2, timeout_s=20, ready_timeout_s=20, handoff=True)}), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "pub":
        publisher(json.loads(sys.argv[2]))
    else:
        main(json.loads(sys.argv[1]))
