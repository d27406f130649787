"""Agentic rollouts: environments, episodes and trajectories (docs/agents.md).

    from flowrl.agents import Step          # what an environment's `step` returns

The contracts are in `flowrl.agents.base` (light: no torch); the episode loop, chat formats,
tools, the gateway and the adapters are imported from their modules when used.
"""

from flowrl.agents.base import (
    ChatFormat, Completion, Env, Generator, ServiceError, Step, ToolCall, Trajectory,
)

__all__ = ["ChatFormat", "Completion", "Env", "Generator", "ServiceError", "Step", "ToolCall", "Trajectory"]
