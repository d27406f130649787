"""A weight-sync peer process for tests: `python -m tests.weights.peer ROLE PORT MODE`."""

import sys

import torch

from flowrl.weights import BucketPlan, WeightGroup, WeightSyncError, layout_digest, layout_of


def weights(fill: float, shape=(256, 1024)):
    g = torch.Generator().manual_seed(1)
    return {"big": torch.randn(*shape, generator=g) + fill, "small": torch.arange(10, dtype=torch.float32) + fill}


def main():
    role, port, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    rank = 0 if role == "pub" else 1
    store = torch.distributed.TCPStore("127.0.0.1", port, None, is_master=False)
    shape = (128, 1024) if mode == "mismatch" and rank == 1 else (256, 1024)
    live = weights(7.0 if rank == 0 else 0.0, shape)
    plan = BucketPlan(layout_of(live), bucket_bytes=1 << 16, direct_bytes=1 << 18)
    buckets = plan.pack(live) if rank == 0 else plan.allocate(live=live)
    try:
        group = WeightGroup.join(epoch=1, rank=rank, world_size=2, store=store, timeout_s=5)
        group.check_layout(layout_digest(plan.layout))
        if mode == "die" and rank == 0:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
        group.broadcast(buckets, drain=None if rank == 0 else (lambda i: plan.drain(i, buckets, live)))
    except WeightSyncError as e:
        print("SYNC_ERROR", e, flush=True)
        return 3
    if rank == 1:
        expect = weights(7.0)
        ok = all(torch.equal(expect[k], live[k]) for k in expect)
        print("EQUAL" if ok else "DIFFERENT", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
