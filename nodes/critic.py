"""Values, GAE advantages and returns for a batch; trains on the returns."""

from pydantic import ConfigDict

import flowrl


class Critic(flowrl.Node):
    """Values, GAE advantages and returns for a batch; trains on the returns."""

    role = "critic"
    stateful = True

    class Config(flowrl.NodeConfig):
        model_config = ConfigDict(extra="allow")  # TODO: typed
