"""Generates responses with the weights of a known policy version."""

from pydantic import ConfigDict

import flowrl


class Rollout(flowrl.Node):
    """Generates responses with the weights of a known policy version."""

    role = "rollout"
    subscribes_weights = True

    class Config(flowrl.NodeConfig):
        model_config = ConfigDict(extra="allow")  # TODO: typed
