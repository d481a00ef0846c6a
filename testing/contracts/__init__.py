"""Plug-in contract suites: pytest classes a plug-in's own tests subclass to check it against the contract
its kind promises (what the core relies on), as we check every shipped plug-in (``tests/contracts/``).

Subclass the suite in a test module named ``test_*.py``, name it ``Test*``, and provide the fixture(s)
its docstring names; every ``test_*`` method of the suite then runs against your plug-in::

    import pytest
    from miles_agent.testing.contracts import TrainerContract

    class TestMyTrainer(TrainerContract):
        @pytest.fixture
        def trainer_class(self):
            return MyTrainer          # called as MyTrainer(model, tokenizer, train_cfg, algo_cfg, temperature=1.0)

Each check raises AssertionError naming what broke. Suites: `TrainerContract`, `EngineContract`,
`WeightTransportContract`, `SandboxContract`, `EnvironmentContract`, `HarnessContract`.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

# suite -> module; imported on first use, so the env-side suites (environment, sandbox) import without torch
_SUITES = {"EngineContract": "engine", "EnvironmentContract": "environment", "HarnessContract": "harness",
           "SandboxContract": "sandbox", "TrainerContract": "trainer", "WeightTransportContract": "transport"}

__all__ = sorted(_SUITES)


def __getattr__(name: str) -> Any:
    if name not in _SUITES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_SUITES[name]}"), name)
