"""The adapter environments: one small class per package, each naming its pin, Python and side-car.

The substance of each adapter is its side-car script (``<package>_side.py``), which uses the
package's own API inside the package's own venv. Registered under ``miles_agent.envs``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from miles_agent.envs.external.base import ADAPTERS, ExternalEnvironment


class OpenEnvEnv(ExternalEnvironment):
    name = "openenv"
    description = "An OpenEnv (openenv 0.10) environment, in-process or through its HTTP/WebSocket server."
    requirements: ClassVar[tuple[str, ...]] = ("openenv==0.10.0",)
    adapter_script = "openenv_side.py"

    def side_config(self) -> dict[str, Any]:  # the shipped example; override any key via the constructor
        return {"env_file": str(ADAPTERS / "examples" / "openenv_spell.py"), "env_class": "SpellEnv",
                "action_class": "SpellAction", "observation_class": "SpellObservation",
                "action_field": "message", "observation_field": "message", "num_tasks": 6,
                "mode": "inprocess", "max_steps": 2, "max_tokens": 24}


class VerifiersEnv(ExternalEnvironment):
    name = "verifiers"
    description = "A Verifiers 0.4 (verifiers.v1) taskset, played by its own harness with its own rewards."
    # uv: verifiers' chat harness is a PEP 723 script that verifiers prepares with `uv sync --script`.
    requirements: ClassVar[tuple[str, ...]] = ("verifiers==0.4.0", "uv")
    adapter_script = "verifiers_side.py"

    def side_config(self) -> dict[str, Any]:  # the shipped example taskset
        return {"taskset": "miles_spell_taskset", "taskset_path": str(ADAPTERS / "examples"), "harness": "null"}


class HarborEnv(ExternalEnvironment):
    name = "harbor"
    description = "Harbor tasks run as Harbor trials (its trial runner, agents and verifiers) against the proxy."
    requirements: ClassVar[tuple[str, ...]] = ("harbor==0.26.0",)
    python = "3.12"  # harbor requires Python >= 3.12
    adapter_script = "harbor_side.py"

    def __init__(self, tasks_dir: str | None = None, **config: Any) -> None:
        super().__init__(**({"tasks_dir": tasks_dir} if tasks_dir else {}), **config)

    def side_config(self) -> dict[str, Any]:  # the shipped example task folder, our local provider and agent
        return {"tasks_dir": str(ADAPTERS / "examples" / "harbor_tasks"), "max_turns": 3}


class HudEnv(ExternalEnvironment):
    name = "hud"
    description = "HUD (hud 0.6) task templates served locally, played by HUD's OpenAI-compatible agent."
    # PyPI renamed the SDK: `hud-python` 0.6.10 is only a stub that tells you to install `hud`.
    requirements: ClassVar[tuple[str, ...]] = ("hud==0.6.10",)
    adapter_script = "hud_side.py"

    def side_config(self) -> dict[str, Any]:  # the shipped example environment and its task rows
        words = ("apple", "river", "cloud", "stone")
        return {"env_file": str(ADAPTERS / "examples" / "hud_spell" / "env.py"), "max_steps": 2, "max_tokens": 24,
                "tasks": [{"template": "spell", "args": {"word": w}} for w in words]}
