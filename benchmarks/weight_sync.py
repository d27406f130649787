"""Weight sync cost vs a raw gloo broadcast of the same bytes, between two real processes.

    python benchmarks/weight_sync.py                 # 50 MB and 400 MB state dicts
    python benchmarks/weight_sync.py --sizes-mb 50 --json out.json

flowrl's path, timed end to end on the receiving side: the publisher packs a state dict of many
tensors (a transformer's shapes) into 32 MiB buckets, broadcasts them over a per-epoch
ProcessGroupGloo built from a TCPStore, and the subscriber unpacks views and copies them into its
own model (`load_state_dict`). The raw baseline broadcasts one flat tensor of the same bytes over
the same kind of group. Target: flowrl <= 1.3x raw.
"""

from __future__ import annotations

import argparse
import json
import os
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


def worker(rank: int, port: int, mb: int, reps: int) -> None:
    import torch
    import torch.distributed as dist

    from flowrl.weights import BucketPlan, WeightGroup, layout_of

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, None, is_master=False)
    sd = state_dict(mb)
    layout = layout_of(sd)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    flat = torch.empty(nbytes // 4)
    plan = BucketPlan(layout, BUCKET)
    # as the runtime does: the publisher packs into its own buffers (a snapshot, so training can go
    # on), the subscriber receives straight into its model's tensors
    buckets = plan.allocate() if rank == 0 else plan.allocate(live=sd)
    results = {"raw": [], "flowrl": [], "snapshot": []}
    for epoch in range(reps):
        group = WeightGroup.join(epoch=epoch, rank=rank, world_size=2, store=store, timeout_s=120)
        store.set(f"barrier-{epoch}-{rank}", "1")
        store.wait([f"barrier-{epoch}-{1 - rank}"])
        t0 = time.perf_counter()
        group.broadcast([flat])
        results["raw"].append(time.perf_counter() - t0)
        store.set(f"barrier2-{epoch}-{rank}", "1")
        store.wait([f"barrier2-{epoch}-{1 - rank}"])
        if rank == 0:
            t0 = time.perf_counter()
            plan.pack(sd, out=buckets)  # publish: snapshot
            results["snapshot"].append(time.perf_counter() - t0)
        store.set(f"barrier3-{epoch}-{rank}", "1")
        store.wait([f"barrier3-{epoch}-{1 - rank}"])
        t0 = time.perf_counter()
        if rank == 0:
            group.broadcast(buckets)
        else:
            group.broadcast(buckets, drain=lambda i: plan.drain(i, buckets, sd))
        results["flowrl"].append(time.perf_counter() - t0)
        group.close()
    print(json.dumps({"rank": rank, "mb": nbytes / 2**20, **results}), flush=True)


def measure(mb: int, reps: int) -> dict:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(store.port), str(mb), str(reps)],
                              stdout=subprocess.PIPE, text=True, env=env) for r in range(2)]
    try:
        out = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    pub, sub = (json.loads(o.strip().splitlines()[-1]) for o in out)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    raw, sync, snap = med(sub["raw"]), med(sub["flowrl"]), med(pub["snapshot"])
    return {"state_dict_mb": round(sub["mb"], 1), "raw_s": raw, "sync_s": sync, "snapshot_s": snap,
            "raw_gbps": sub["mb"] / 1024 / raw, "ratio": sync / raw, "ratio_with_snapshot": (sync + snap) / raw}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[50, 400])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    rows = [measure(mb, args.reps) for mb in args.sizes_mb]
    print(f"{'state dict':>11} {'raw gloo s':>11} {'sync s':>8} {'sync/raw':>9} {'snapshot s':>11} "
          f"{'(snap+sync)/raw':>16} {'raw GB/s':>9}")
    for r in rows:
        print(f"{r['state_dict_mb']:>8.1f} MB {r['raw_s']:>11.3f} {r['sync_s']:>8.3f} {r['ratio']:>8.2f}x "
              f"{r['snapshot_s']:>11.3f} {r['ratio_with_snapshot']:>15.2f}x {r['raw_gbps']:>9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
