"""Tiny node classes with placement roles, for planner tests that must not depend on the
built-in nodes' configs: `kind: "tests.placement.roles:Actor"`."""

import flowrl


class _Alone(flowrl.Source):
    inputs = ()
    outputs = ()


class Actor(_Alone):
    role = "actor"


class Critic(_Alone):
    role = "critic"


class Rollout(_Alone):
    role = "rollout"


class Reference(_Alone):
    role = "reference"


class Reward(_Alone):
    role = "reward"


class Helper(_Alone):
    """No role: no sharing rules; on a GPU host `auto` runs it on the CPU."""


class Source(flowrl.Source):
    role = "rollout"
    inputs = ()
    outputs = ("out",)


class Sink(flowrl.Node):
    role = "actor"
    inputs = ("in",)
    outputs = ()


class HiddenSource(flowrl.Source):
    """Sends tensors in its compute dtype (hidden states) on `out`."""

    role = "rollout"
    inputs = ()
    outputs = ("out",)
    compute_dtype_outputs = ("out",)


class Trainer(_Alone):
    """A stateful trainer that publishes weights."""

    role = "actor"
    stateful = True
    publishes_weights = True


class MergingTrainer(Trainer):
    merge_replicas = "average"


class Subscriber(_Alone):
    role = "rollout"
    subscribes_weights = True


class Engine(_Alone):
    """A rollout engine that reserves a share of the card (vLLM's gpu_memory_utilization)."""

    role = "rollout"

    class Config(flowrl.NodeConfig):
        gpu_memory_utilization: float = 0.9


class ModelActor(_Alone):
    """A trainer whose config names its model (`model: {type: hf, path: ...}`), as the built-in actor's does."""

    role = "actor"

    class Config(flowrl.NodeConfig):
        model: dict = {"type": "tiny"}
        train: dict = {}
