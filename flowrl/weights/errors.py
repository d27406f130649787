"""The ways a weight sync fails; every one leaves a subscriber on its previous version."""


class WeightSyncError(RuntimeError):
    """A weight sync failed (peer died, timeout, a member refused); the epoch's group is gone and a
    new epoch is needed. Subscribers keep their previous version, label and content."""


class LayoutMismatchError(WeightSyncError):
    """A subscriber's tensors are not what the publisher publishes (name, shape or dtype)."""


class StoreAuthError(WeightSyncError):
    """A value in the weight store was not written by a holder of the run's secret."""
