"""Sandbox backends (installed as miles_agent.sandboxes); the core builds them by name (miles_agent/build.py)."""
