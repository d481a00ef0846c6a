"""Harbor side-car adapter (runs in a Python 3.12 venv with harbor; see sidecar.py for the protocol).

config (``env.options``, `adapters.HarborOptions`): ``tasks_dir`` (a folder of Harbor task directories,
or one task directory), ``agent`` (a Harbor agent name such as ``oracle``, or ``import_path`` of one;
default our `ProxyShellAgent`, which talks to the proxy), ``environment_import_path`` (default our
bubblewrap `LocalEnvironment`; a Harbor environment ``type`` such as ``docker`` via
``environment_type``), ``trials_dir``, ``max_turns``, ``max_tokens``, ``skills`` (Harbor's agent
skills), ``reward_key``. Each episode is one Harbor trial (``Trial.create(TrialConfig).run()``): Harbor
sets up the environment, runs the agent and its verifier (``tests/test.sh``).

The reward: every key of ``verifier_result.rewards`` (reward.txt or a multi-key reward.json) is a part,
and the scalar follows Harbor's own rule (``harbor/cli/jobs.py`` ``_primary_reward``): the ``reward``
key, else the only key; several keys and no ``reward`` need ``reward_key``. ``oracle`` plays the task
with Harbor's oracle agent (its ``solution/solve.sh``), no model.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PLUGINS = "harbor_plugins"


def _task_dirs(config: dict) -> dict[str, Path]:
    root = Path(config["tasks_dir"])
    if (root / "task.toml").is_file():  # one task folder
        return {root.name: root}
    if not root.is_dir():
        raise FileNotFoundError(f"tasks_dir {root} is not a folder; point --tasks at Harbor task directories")
    found = {d.name: d for d in sorted(root.iterdir()) if (d / "task.toml").is_file()}
    if not found:
        raise FileNotFoundError(f"{root} holds no Harbor task (a folder with task.toml)")
    return found


#: Dockerfile instructions the local provider honours: it copies files in (the host userland is the image).
_FILE_ONLY = {"FROM", "COPY", "ADD", "WORKDIR", "ENV", "ARG", "LABEL", "USER", "CMD", "ENTRYPOINT", "EXPOSE", "SHELL"}


def _needs_build(task: Path) -> str:
    """The first instruction of the task's Dockerfile that only an image build can honour, or ""."""
    dockerfile = task / "environment" / "Dockerfile"
    if not dockerfile.is_file():
        return ""
    for line in dockerfile.read_text().splitlines():
        word = line.strip().split(" ", 1)[0].upper()
        if word and not word.startswith("#") and word not in _FILE_ONLY:
            return line.strip().rstrip("\\ ")[:60]
    return ""


async def tasks(config: dict) -> list[dict]:
    found = _task_dirs(config)
    if not (config.get("environment_type") or config.get("environment_import_path")):
        built = {name: why for name, path in found.items() if (why := _needs_build(path))}
        if built:
            name, why = next(iter(built.items()))
            raise ValueError(f"{len(built)} task(s) ({', '.join(sorted(built))}) need their image built ({name}: "
                             f"`{why}`); the local provider runs file-only Dockerfiles on the host userland: use "
                             "env.options.environment_type=docker (a container runtime) for them")
    return [{"id": name, "prompt": [], "info": {"path": str(path)}} for name, path in found.items()]


def primary_reward(rewards: dict, reward_key: str = "") -> float:
    """Harbor's primary reward: ``reward``, else the only key; ``reward_key`` names another."""
    key = reward_key or "reward"
    if key in rewards:
        return float(rewards[key])
    if len(rewards) == 1 and not reward_key:
        return float(next(iter(rewards.values())))
    if not rewards:
        return 0.0
    raise ValueError(f"the verifier's reward.json has keys {sorted(rewards)} and no {key!r}: Harbor gives such a "
                     "trial no primary reward; choose one with env.options.reward_key=KEY")


async def _trial(config: dict, task_id: str, agent: str, agent_env: dict) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))  # harbor imports our plug-ins by import_path
    from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig, TrialConfig
    from harbor.trial.trial import Trial

    skills = list(config.get("skills") or ())
    agent_cfg = (AgentConfig(import_path=agent, model_name="policy", skills=skills) if ":" in agent
                 else AgentConfig(name=agent, skills=skills))
    agent_cfg.env = agent_env
    env_cfg = (EnvironmentConfig(type=config["environment_type"]) if config.get("environment_type")
               else EnvironmentConfig(import_path=config.get("environment_import_path") or f"{PLUGINS}:LocalEnvironment"))
    keep = bool(config.get("trials_dir"))  # a configured trials_dir keeps Harbor's trial records
    trials_dir = Path(config.get("trials_dir") or tempfile.mkdtemp(prefix="harbor-trials-"))
    trial_cfg = TrialConfig(task=TaskConfig(path=_task_dirs(config)[task_id]), trials_dir=trials_dir,
                            agent=agent_cfg, environment=env_cfg)
    try:
        result = await (await Trial.create(trial_cfg)).run()
    finally:
        if not keep:
            shutil.rmtree(trials_dir, ignore_errors=True)
    if result.exception_info is not None and result.verifier_result is None:
        raise RuntimeError(f"harbor trial failed: {result.exception_info.exception_type}: "
                           f"{result.exception_info.exception_message}")
    rewards = dict((result.verifier_result.rewards or {}) if result.verifier_result else {})
    return {"reward": primary_reward(rewards, config.get("reward_key") or ""),
            "parts": {k: float(v) for k, v in rewards.items() if k != (config.get("reward_key") or "reward")},
            "info": {"trial": str(trials_dir) if keep else "", "agent": agent, "rewards": rewards}}


async def episode(config: dict, task_id: str, base_url: str, api_key: str) -> dict:
    agent_env = {"MILES_PROXY_BASE_URL": base_url, "MILES_PROXY_API_KEY": api_key,
                 "MILES_PROXY_MAX_TURNS": str(config.get("max_turns", 3))}
    if config.get("max_tokens"):
        agent_env["MILES_PROXY_MAX_TOKENS"] = str(config["max_tokens"])
    return await _trial(config, task_id, config.get("agent") or f"{PLUGINS}:ProxyShellAgent", agent_env)


async def oracle(config: dict, task_id: str) -> dict:
    solution = _task_dirs(config)[task_id] / "solution" / "solve.sh"
    if not solution.is_file():
        raise FileNotFoundError(f"task {task_id} has no solution/solve.sh for Harbor's oracle agent")
    return await _trial(config, task_id, "oracle", {})
