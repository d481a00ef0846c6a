"""The adapter environments: one small class per package, each naming its pin, Python, side-car and options.

The substance of each adapter is its side-car script (``<package>_side.py``), which uses the
package's own API inside the package's own venv. Registered under ``miles_agent.envs``. Each class's
``options_type`` types ``env.options`` (``env.options.id=my-taskset env.options.args.difficulty=hard``):
an unknown key fails before any model loads, naming the valid ones (build.env_options).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from miles_agent.envs.external.base import ADAPTERS, ExternalEnvironment


@dataclass(frozen=True)
class VerifiersOptions:
    id: str = ""  # the taskset id (a package importable in the venv: installed by `packages`, or under `path`)
    env_id: str = ""  # a verifiers Env id to pair with the taskset (default: the taskset's own Env)
    path: str = ""  # a folder put on sys.path first (a taskset that is not installed)
    args: dict[str, Any] = field(default_factory=dict)  # the taskset's settings (its TasksetConfig fields)
    env_args: dict[str, Any] = field(default_factory=dict)  # env-level settings (its EnvConfig fields, roles)
    # a verifiers harness id; "" = the taskset's default; `null` (YAML reads it as None) = its plain chat program
    harness: str | None = ""
    runtime: str = "subprocess"  # the agent runtime type (verifiers' default is Prime's hosted sandboxes)
    num_tasks: int = 0  # 0 = every task of a finite taskset, `INFINITE_TASKS` of an infinite one
    packages: tuple[str, ...] = ()  # extra pip specifiers installed into the adapter's venv


@dataclass(frozen=True)
class OpenEnvOptions:
    env: str = ""  # "package.module:EnvClass" (imported as a package) or "path/to/file.py:EnvClass"
    action: str = ""  # its Action class, same forms ("" = the class the env's module names *Action)
    observation: str = ""  # its Observation class ("" = the module's *Observation)
    path: str = ""  # a folder put on sys.path first (the folder holding the env's package)
    action_field: str = ""  # the text field the model's reply fills ("" = the action's only str field)
    observation_field: str = ""  # the text field shown to the model ("" = the first str field it has)
    reset: tuple[dict[str, Any], ...] = ()  # one row of reset() keywords per task (seed, question_id ...)
    num_tasks: int = 0  # with no `reset` rows: task i = reset(seed=i)
    mode: str = "inprocess"  # inprocess | server (OpenEnv's own FastAPI/WebSocket server on loopback)
    max_steps: int = 4
    max_tokens: int = 0  # 0 = the proxy's env.max_new_tokens_per_turn
    packages: tuple[str, ...] = ()
    # the older spellings of the shipped example, kept working
    env_file: str = ""
    env_class: str = ""
    action_class: str = ""
    observation_class: str = ""


@dataclass(frozen=True)
class HarborOptions:
    tasks_dir: str = ""  # a folder of Harbor task directories (also --tasks)
    agent: str = ""  # a Harbor agent name (`oracle`, ...) or import_path ("" = the proxy shell agent)
    environment_type: str = ""  # a Harbor environment provider (`docker` ...); "" = our bubblewrap one
    environment_import_path: str = ""
    trials_dir: str = ""  # keep Harbor's trial records there
    max_turns: int = 3  # the proxy shell agent's turns
    max_tokens: int = 0  # the proxy shell agent's max_tokens per turn (0 = not sent: the proxy's limit)
    skills: tuple[str, ...] = ()  # Harbor agent skills (folders or sources Harbor resolves), for agents that take them
    reward_key: str = ""  # the reward.json key that is the scalar when it has several and no `reward`


@dataclass(frozen=True)
class HudOptions:
    env_file: str = ""  # a .py file or folder declaring a hud.Environment
    env_name: str = ""  # which one, when it declares several
    taskset: str = ""  # the env's own taskset: a .py / folder / .json / .jsonl HUD loads, or file.py:function
    #                    (default: the tasks env_file declares)
    tasks: tuple[dict[str, Any], ...] = ()  # or rows {"template": id, "args": {...}}
    runtime: str = "local"  # local (in the side-car) | subprocess (HUD's child-process server)
    max_steps: int = 4
    max_tokens: int = 0
    packages: tuple[str, ...] = ()


class OpenEnvEnv(ExternalEnvironment):
    name = "openenv"
    description = "An OpenEnv (openenv 0.10) environment, in-process or through its HTTP/WebSocket server."
    requirements: ClassVar[tuple[str, ...]] = ("openenv==0.10.0",)
    adapter_script = "openenv_side.py"
    options_type: ClassVar[type] = OpenEnvOptions

    def side_config(self) -> dict[str, Any]:  # the shipped example; override any key via env.options
        return {"env": f"{ADAPTERS / 'examples' / 'openenv_spell.py'}:SpellEnv", "num_tasks": 6,
                "mode": "inprocess", "max_steps": 2}


class VerifiersEnv(ExternalEnvironment):
    name = "verifiers"
    description = "A Verifiers 0.4 (verifiers.v1) taskset, played by its own harness with its own rewards."
    # uv: verifiers' chat harness is a PEP 723 script that verifiers prepares with `uv sync --script`.
    requirements: ClassVar[tuple[str, ...]] = ("verifiers==0.4.0", "uv")
    adapter_script = "verifiers_side.py"
    options_type: ClassVar[type] = VerifiersOptions
    oracle_source: ClassVar[str] = "each task's reference answer, as the model's reply"

    def side_config(self) -> dict[str, Any]:  # the shipped example taskset
        if self.given.get("id"):
            return {"runtime": "subprocess"}
        return {"id": "miles_spell_taskset", "path": str(ADAPTERS / "examples"), "harness": "null",
                "runtime": "subprocess"}


class HarborEnv(ExternalEnvironment):
    name = "harbor"
    description = "Harbor tasks run as Harbor trials (its trial runner, agents and verifiers) against the proxy."
    requirements: ClassVar[tuple[str, ...]] = ("harbor==0.26.0",)
    python = "3.12"  # harbor requires Python >= 3.12
    adapter_script = "harbor_side.py"
    options_type: ClassVar[type] = HarborOptions
    oracle_source: ClassVar[str] = "Harbor's oracle agent (the task's solution/solve.sh)"

    def side_config(self) -> dict[str, Any]:  # the shipped example task folder, our local provider and agent
        return {"tasks_dir": str(ADAPTERS / "examples" / "harbor_tasks"), "max_turns": 3}


class HudEnv(ExternalEnvironment):
    name = "hud"
    description = "HUD (hud 0.6) task templates served locally, played by HUD's OpenAI-compatible agent."
    # PyPI renamed the SDK: `hud-python` 0.6.10 is only a stub that tells you to install `hud`.
    requirements: ClassVar[tuple[str, ...]] = ("hud==0.6.10",)
    adapter_script = "hud_side.py"
    options_type: ClassVar[type] = HudOptions

    def side_config(self) -> dict[str, Any]:  # the shipped example environment and its task rows
        if self.given.get("env_file"):
            return {"max_steps": 4}
        words = ("apple", "river", "cloud", "stone")
        return {"env_file": str(ADAPTERS / "examples" / "hud_spell" / "env.py"), "max_steps": 2, "max_tokens": 24,
                "tasks": [{"template": "spell", "args": {"word": w}} for w in words]}
