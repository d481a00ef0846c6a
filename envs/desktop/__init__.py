"""desktop: computer-use tasks on an X desktop inside the sandbox (see env.py and docs/computer-use.md)."""

from .env import DesktopEnv, DesktopOptions, DesktopSession

__all__ = ["DesktopEnv", "DesktopOptions", "DesktopSession"]
