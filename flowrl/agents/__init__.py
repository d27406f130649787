"""Agentic rollouts: environments, episodes and trajectories (see flowrl.agents.base)."""
