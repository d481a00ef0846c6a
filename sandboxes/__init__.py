"""Sandbox backends (installed as miles_agent.sandboxes)."""
