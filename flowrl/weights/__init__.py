"""Weight sync from trainer to rollouts: bucketed broadcasts over a per-epoch torch.distributed group."""

from flowrl.weights.buckets import BucketPlan, layout_digest, layout_of, weights_digest
from flowrl.weights.group import WeightGroup, WeightSyncError, host_store

__all__ = ["BucketPlan", "WeightGroup", "WeightSyncError", "host_store", "layout_digest", "layout_of", "weights_digest"]
