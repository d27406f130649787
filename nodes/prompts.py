"""Turns scheduler tickets into prompt batches from a procedural task (the data cursor)."""

from pydantic import ConfigDict

import flowrl


class Prompts(flowrl.Source):
    """Turns scheduler tickets into prompt batches from a procedural task (the data cursor)."""


    class Config(flowrl.NodeConfig):
        model_config = ConfigDict(extra="allow")  # TODO: typed
