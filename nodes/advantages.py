"""Group-normalised advantages (GRPO): no critic needed."""

from pydantic import ConfigDict

import flowrl


class GroupAdvantages(flowrl.Node):
    """Group-normalised advantages (GRPO): no critic needed."""


    class Config(flowrl.NodeConfig):
        model_config = ConfigDict(extra="allow")  # TODO: typed
