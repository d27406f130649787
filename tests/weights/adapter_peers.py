"""A rollout-side peer for adapter-version tests: `python -m tests.weights.adapter_peers CONFIG_JSON`.

It builds a builtin engine (the tiny model, seed 0: the same base weights as the test's), joins
the publisher's epoch as the runtime's subscriber would and receives `versions` versions; after
each it does what the runtime then does (`load_weights(received())`) and prints one JSON line: the
version, the digest of the engine's weights (base + B @ A), the subscriber's digest and the bytes
it received into. The run's secret comes in FLOWRL_TEST_SECRET.
"""

from __future__ import annotations

import json
import os
import sys

import torch

TARGETS = ("attn.qkv", "attn.proj")
"""The tiny model's attention projections: what the tests' adapters target."""


def random_adapters(weights: dict[str, torch.Tensor], seed: int, r: int = 4,
                    targets: tuple[str, ...] = TARGETS) -> dict[str, torch.Tensor]:
    """`P.lora_A` [r, in] and `P.lora_B` [out, r] (pre-scaled) for every 2-D `P.weight` whose name
    holds one of `targets`: a trainer's adapter version, different for every seed."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in weights.items():
        if name.endswith(".weight") and w.dim() == 2 and any(f".{t}." in f".{name}" for t in targets):
            stem = name[: -len(".weight")]
            out[stem + ".lora_A"] = torch.randn(r, w.shape[1], generator=g) * 0.1
            out[stem + ".lora_B"] = torch.randn(w.shape[0], r, generator=g) * 0.1
    return out


def main(cfg: dict) -> None:
    from flowrl.engines import build_engine
    from flowrl.weights import WeightSubscriber, WeightSyncError, layout_of, weights_digest

    engine = build_engine({"type": "builtin"}, model={"type": "tiny"}, seed=0)
    sub = WeightSubscriber(engine.weights(), bucket_bytes=32 << 10, version=0,
                           apply_adapters=cfg["apply_adapters"])
    layout = layout_of(engine.weights())
    try:
        sub.join(1, 1, 2, tuple(cfg["addr"]), os.environ["FLOWRL_TEST_SECRET"], timeout_s=20, ready_timeout_s=20)
        for _ in range(cfg["versions"]):
            version = sub.receive()
            received = sub.received()
            engine.load_weights(received.items(), version)  # what the rollout's load_weights does
            print(json.dumps({"version": version, "engine": weights_digest(engine.weights(), layout),
                              "subscriber": sub.digest(), "handed": sorted(received)[:2],
                              "bytes": sub.plan.nbytes(sub.staging)}), flush=True)
    except WeightSyncError as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(json.loads(sys.argv[1]))
