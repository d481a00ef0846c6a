"""arith-tools: the built-in multi-turn task with a verifiable reward."""

from miles_agent.envs.arith_tools.env import ArithToolsEnv

__all__ = ["ArithToolsEnv"]
