"""Adapters that run other RL-environment packages (Verifiers, OpenEnv, Harbor, ...) in their own venvs.

`ExternalEnvironment` + a side-car script per package; see base.py, and docs/ecosystem.md.
"""

from miles_agent.envs.external.base import ExternalEnvironment, ExternalSession
from miles_agent.envs.external.process import SideCar, SideCarError
from miles_agent.envs.external.venv import PackageVenv

__all__ = ["ExternalEnvironment", "ExternalSession", "PackageVenv", "SideCar", "SideCarError"]
