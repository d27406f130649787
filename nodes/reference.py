"""Frozen copy of the initial policy: reference log-probs for the KL term."""

from pydantic import ConfigDict

import flowrl


class Reference(flowrl.Node):
    """Frozen copy of the initial policy: reference log-probs for the KL term."""

    role = "reference"

    class Config(flowrl.NodeConfig):
        model_config = ConfigDict(extra="allow")  # TODO: typed
