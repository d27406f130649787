"""Scores responses with a rule from a task or any module:function."""

from pydantic import ConfigDict

import flowrl


class Reward(flowrl.Node):
    """Scores responses with a rule from a task or any module:function."""

    role = "reward"

    class Config(flowrl.NodeConfig):
        model_config = ConfigDict(extra="allow")  # TODO: typed
