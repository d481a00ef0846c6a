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

from miles_agent.testing.contracts.engine import EngineContract
from miles_agent.testing.contracts.environment import EnvironmentContract
from miles_agent.testing.contracts.harness import HarnessContract
from miles_agent.testing.contracts.sandbox import SandboxContract
from miles_agent.testing.contracts.trainer import TrainerContract
from miles_agent.testing.contracts.transport import WeightTransportContract

__all__ = ["EngineContract", "EnvironmentContract", "HarnessContract", "SandboxContract", "TrainerContract",
           "WeightTransportContract"]
