"""Weight sync from trainer to rollouts: whole versions over a per-epoch torch.distributed group.

    pub = WeightPublisher(model.state_dict, secret=secret)           # trainer
    sub = WeightSubscriber(model.state_dict())                       # each rollout
See `publisher` and `subscriber` for the worked loops, `handshake` for the timeouts, `store` for
what the run's secret protects.
"""

from flowrl.weights.buckets import BucketPlan
from flowrl.weights.errors import LayoutMismatchError, StoreAuthError, WeightSyncError
from flowrl.weights.group import WeightGroup, host_store
from flowrl.weights.layout import layout_digest, layout_mismatch, layout_of, serving_layout, weights_digest
from flowrl.weights.publisher import WeightPublisher
from flowrl.weights.store import SealedStore, WeightStore
from flowrl.weights.subscriber import WeightSubscriber

__all__ = ["BucketPlan", "LayoutMismatchError", "SealedStore", "StoreAuthError", "WeightGroup", "WeightPublisher",
           "WeightStore", "WeightSubscriber", "WeightSyncError", "host_store", "layout_digest", "layout_mismatch",
           "layout_of", "serving_layout", "weights_digest"]
