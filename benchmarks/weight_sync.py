"""Weight sync cost vs a raw gloo broadcast of the same bytes, between two real processes.

    python benchmarks/weight_sync.py                 # 60 MB and 400 MB state dicts
    python benchmarks/weight_sync.py --sizes-mb 60 --reps 3 --json out.json

flowrl's path, timed on the receiving side: `WeightSubscriber.receive()` on an nn.Module (say
ready, wait for the go, receive the version tensor and every 32 MiB bucket into the idle half of
the double buffer, then point the module's tensors at it), against a `WeightPublisher` that
serves a snapshot of a state dict of many tensors (a transformer's shapes). The raw baseline
broadcasts one flat tensor of the same bytes over a gloo group on the same loopback address.
`copy s` is what a subscriber given a dict of tensors (copy mode) adds: one copy of the whole
version out of staging; `snapshot s` is the publisher's copy out of training. Target: sync/raw
<= 1.3x.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import secrets
import subprocess
import sys
import time

BUCKET = 32 << 20


def state_dict(mb: int):
    """Transformer-like shapes adding up to about `mb` MiB of float32."""
    import torch

    d = 1024
    out, total, i = {}, 0, 0
    target = mb << 20
    while total < target:
        for name, shape in ((f"l{i}.qkv", (3 * d, d)), (f"l{i}.proj", (d, d)), (f"l{i}.up", (4 * d, d)),
                            (f"l{i}.down", (d, 4 * d)), (f"l{i}.norm", (d,))):
            t = torch.randn(shape)
            out[name] = t
            total += t.numel() * 4
            if total >= target:
                break
        i += 1
    return out


def module_of(tensors: dict):
    import torch

    root = torch.nn.Module()
    for name, t in tensors.items():
        layer, leaf = name.split(".")
        if not hasattr(root, layer):
            root.add_module(layer, torch.nn.Module())
        getattr(root, layer).register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root


def barrier(store, name: str, rank: int) -> None:
    store.set(f"{name}/{rank}", "1")
    store.wait([f"{name}/{1 - rank}"], datetime.timedelta(seconds=300))


def worker(rank: int, mb: int, reps: int, secret: str) -> None:
    import torch

    from flowrl.weights import WeightGroup, WeightPublisher, WeightSubscriber
    from flowrl.weights.store import connect

    torch.set_num_threads(1)
    sd = state_dict(mb)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    flat = torch.empty(nbytes // 4)
    if rank == 0:
        pub = WeightPublisher(lambda: sd, bucket_bytes=BUCKET, secret=secret)
        print(json.dumps({"addr": pub.store_addr}), flush=True)
        addr = pub.store_addr
    else:
        addr = tuple(json.loads(sys.stdin.readline())["addr"])
        sub = WeightSubscriber(module_of(sd), bucket_bytes=BUCKET)  # swap: sd's storage is the module's until v0
        sub.join(1, 1, 2, addr, secret, timeout_s=300, ready_timeout_s=300)
        copy_target = {k: torch.empty_like(v) for k, v in sd.items()}
    store = connect(addr, secret, timeout_s=300)
    raw = WeightGroup.join(epoch=0, rank=rank, world_size=2, store=store.child("raw"), timeout_s=300)
    results = {"raw": [], "sync": [], "copy": [], "snapshot": []}
    for rep in range(reps + 1):  # the first is a warm-up (group forming, first touch of the buffers)
        barrier(store, f"raw-{rep}", rank)
        t0 = time.perf_counter()
        raw.broadcast([flat])
        raw_s = time.perf_counter() - t0
        if rank == 0:
            t0 = time.perf_counter()
            pub.snapshot(rep)
            snap_s = time.perf_counter() - t0
        barrier(store, f"sync-{rep}", rank)
        t0 = time.perf_counter()
        if rank == 0:
            pub.serve(1, 2, timeout_s=300, ready_timeout_s=300)
        else:
            assert sub.receive() == rep
        sync_s = time.perf_counter() - t0
        if rep:
            results["raw"].append(raw_s)
            results["sync"].append(sync_s)
            if rank == 0:
                results["snapshot"].append(snap_s)
            else:
                t0 = time.perf_counter()
                for i in range(len(sub.plan)):  # what copy mode (a dict target) does after the broadcast
                    sub.plan.unpack(i, sub._serving, copy_target)
                results["copy"].append(time.perf_counter() - t0)
    print(json.dumps({"rank": rank, "mb": nbytes / 2**20, **results}), flush=True)


def measure(mb: int, reps: int) -> dict:
    secret = secrets.token_hex(32)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLOWRL_BENCH_SECRET": secret}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(mb), str(reps)], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for r in range(2)]
    try:
        procs[1].stdin.write(procs[0].stdout.readline())  # the publisher's store address
        procs[1].stdin.flush()
        out = [p.communicate(timeout=900)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    pub, sub = (json.loads(o.strip().splitlines()[-1]) for o in out)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    raw, sync, copy, snap = med(sub["raw"]), med(sub["sync"]), med(sub["copy"]), med(pub["snapshot"])
    return {"state_dict_mb": round(sub["mb"], 1), "raw_s": raw, "sync_s": sync, "copy_s": copy, "snapshot_s": snap,
            "raw_gbps": sub["mb"] / 1024 / raw, "ratio": sync / raw, "ratio_with_snapshot": (sync + snap) / raw}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), os.environ["FLOWRL_BENCH_SECRET"])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[60, 400])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    rows = [measure(mb, args.reps) for mb in args.sizes_mb]
    print(f"{'state dict':>11} {'raw gloo s':>11} {'sync s':>8} {'sync/raw':>9} {'copy s':>7} {'snapshot s':>11} "
          f"{'(snap+sync)/raw':>16} {'raw GB/s':>9}")
    for r in rows:
        print(f"{r['state_dict_mb']:>8.1f} MB {r['raw_s']:>11.3f} {r['sync_s']:>8.3f} {r['ratio']:>8.2f}x "
              f"{r['copy_s']:>7.3f} {r['snapshot_s']:>11.3f} {r['ratio_with_snapshot']:>15.2f}x {r['raw_gbps']:>9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
