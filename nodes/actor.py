"""PPO / GRPO policy updates; publishes weights after each update."""

from pydantic import ConfigDict

import flowrl


class Actor(flowrl.Sink):
    """PPO / GRPO policy updates; publishes weights after each update."""

    role = "actor"
    stateful = True
    publishes_weights = True

    class Config(flowrl.NodeConfig):
        model_config = ConfigDict(extra="allow")  # TODO: typed
