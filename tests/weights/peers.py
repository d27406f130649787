"""Weight-sync peers for tests, each its own process: `python -m tests.weights.peers ROLE CONFIG_JSON`.

The run's secret comes in the environment (FLOWRL_TEST_SECRET), as a launcher would hand it over.
A subscriber runs the ops of its config and prints one JSON line per op; a publisher prints its
store address first, then serves the rounds of its config.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch

SHAPES = {"emb": (64, 256), "l0.w": (64, 64), "l0.b": (64,), "l1.w": (128, 64), "l1.b": (128,), "head": (64, 256)}


def master(version: int, dtype: str = "float32", shapes: dict | None = None) -> dict[str, torch.Tensor]:
    """The trainer's weights at `version`: different for every version, the same in every process."""
    g = torch.Generator().manual_seed(1000 + version)
    out = {name: torch.randn(*shape, generator=g).to(getattr(torch, dtype)) for name, shape in (shapes or SHAPES).items()}
    out["step"] = torch.tensor([version], dtype=torch.int64)  # never cast
    return out


def expected_digest(version: int, serving_dtype: str) -> str:
    from flowrl.weights import layout_of, weights_digest

    w = {k: (v.to(getattr(torch, serving_dtype)) if v.is_floating_point() else v) for k, v in master(version).items()}
    return weights_digest(w, layout_of(w))


def module_of(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """An nn.Module whose state_dict is `tensors` (floats as parameters, the rest as buffers)."""
    root = torch.nn.Module()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        if t.is_floating_point():
            mod.register_parameter(leaf, torch.nn.Parameter(t.clone()))
        else:
            mod.register_buffer(leaf, t.clone())
    return root


def subscriber(cfg: dict) -> None:
    from flowrl.weights import WeightSubscriber, WeightSyncError

    secret = os.environ["FLOWRL_TEST_SECRET"]
    loaded: list[dict] = []
    if cfg.get("loader"):
        def load(named, version):
            names = [name for name, t in named]
            loaded.append({"version": version, "names": names})
        target = load
    else:
        shapes = dict(SHAPES, **{k: tuple(v) for k, v in cfg.get("shapes", {}).items()})
        target = master(0, cfg.get("dtype", "float32"), shapes)  # version 0: what the node starts with
        if cfg.get("module"):
            target = module_of(target)
    sub = WeightSubscriber(target, bucket_bytes=cfg.get("bucket_bytes", 32 << 10), version=0)
    go_waits: list[int] = []  # rounds whose receive waited for the publisher's go
    import flowrl.weights.subscriber as subscriber_module

    def await_release(store, r, *args, _wait=subscriber_module.await_release, **kw):
        go_waits.append(r)
        return _wait(store, r, *args, **kw)
    subscriber_module.await_release = await_release
    if cfg.get("die_in_broadcast"):  # kill -9 of this member once its group is formed, before a byte moves
        from flowrl.weights.group import WeightGroup

        WeightGroup.broadcast = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    for op in cfg["ops"]:
        out: dict = {"op": op["op"]}
        try:
            if op["op"] == "join":
                sub.join(op["epoch"], op["rank"], op["world"], tuple(cfg["addr"]), secret,
                         timeout_s=op.get("timeout_s", 20), ready_timeout_s=op.get("ready_timeout_s", 20))
            elif op["op"] == "ahead":  # ready for the next round now, before its receive
                out["ahead"] = sub.announce_ahead()
            elif op["op"] == "busy":
                import time

                time.sleep(op["seconds"])  # a batch that takes longer than the collective timeout
            else:
                if "fault_after" in op:
                    def fault(i, k=op["fault_after"]):
                        if i == k:
                            out["staged_new"] = sub.plan.bucket_views(0, sub.staging)["emb"][0, 0].item() != \
                                sub.live["emb"][0, 0].item()
                            raise RuntimeError(f"injected fault after tensor {k}")
                sub.fault_hook = fault if "fault_after" in op else None
                out["received"] = sub.receive()
        except WeightSyncError as e:
            out["error"] = f"{type(e).__name__}: {e}"
        out["version"] = sub.version
        out["go_waits"] = list(go_waits)
        out["digest"] = sub.digest() if sub.version > 0 or sub.live is not None else None
        if cfg.get("module"):  # what the module itself now holds, read afresh
            from flowrl.weights import weights_digest

            out["module_digest"] = weights_digest(target.state_dict(), sub.layout)
        print(json.dumps(out), flush=True)
    if loaded:
        print(json.dumps({"op": "loaded", "calls": loaded}), flush=True)


def publisher(cfg: dict) -> None:
    from flowrl.weights import WeightPublisher, WeightSyncError

    weights = master(1)
    pub = WeightPublisher(lambda: weights, bucket_bytes=cfg.get("bucket_bytes", 32 << 10),
                          secret=os.environ["FLOWRL_TEST_SECRET"])
    pub.snapshot(1)
    print(json.dumps({"addr": pub.store_addr}), flush=True)
    for n, r in enumerate(cfg["rounds"]):
        weights.update(master(r["version"]))
        pub.snapshot(r["version"])
        if "kill_before" in r:
            pub.fault_hook = lambda i, k=r["kill_before"]: os.kill(os.getpid(), signal.SIGKILL) if i == k else None
        try:
            print(json.dumps({"served": pub.serve(r["epoch"], r["world"], timeout_s=20, ready_timeout_s=20)}), flush=True)
        except WeightSyncError as e:
            print(json.dumps({"error": str(e)}), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"sub": subscriber, "pub": publisher}[sys.argv[1]](json.loads(sys.argv[2]))
