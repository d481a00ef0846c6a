"""swe: SWE-bench-format coding tasks (see env.py), with instances the project ships (shipped.py)."""

from miles_agent.envs.swe.env import SWEEnv

__all__ = ["SWEEnv"]
