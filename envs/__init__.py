"""Environments (installed as miles_agent.envs)."""
