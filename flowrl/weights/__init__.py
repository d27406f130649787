"""Weight sync from trainer to rollouts: bucketed broadcasts over a per-epoch torch.distributed group."""

from flowrl.weights.buckets import empty_buckets, layout_digest, layout_of, pack, plan_buckets, unpack
from flowrl.weights.group import WeightGroup, WeightSyncError, host_store

__all__ = ["WeightGroup", "WeightSyncError", "empty_buckets", "host_store", "layout_digest", "layout_of",
           "pack", "plan_buckets", "unpack"]
