"""Harbor side-car adapter (runs in a Python 3.12 venv with harbor; see sidecar.py for the protocol).

config: ``tasks_dir`` (a folder of Harbor task directories), ``agent`` (a Harbor agent name such as
``oracle``, or ``import_path`` of one; default our `ProxyShellAgent`, which talks to the proxy),
``environment_import_path`` (default our bubblewrap `LocalEnvironment`; a Harbor environment ``type``
such as ``docker`` via ``environment_type``), ``trials_dir``, ``max_turns``. Each episode is one
Harbor trial (``Trial.create(TrialConfig).run()``): Harbor sets up the environment, runs the agent and
its verifier (``tests/test.sh``), and its ``verifier_result.rewards`` is the reward.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PLUGINS = "harbor_plugins"


def _task_dirs(config: dict) -> dict[str, Path]:
    root = Path(config["tasks_dir"])
    return {d.name: d for d in sorted(root.iterdir()) if (d / "task.toml").is_file()}


async def tasks(config: dict) -> list[dict]:
    return [{"id": name, "prompt": [], "info": {"path": str(path)}} for name, path in _task_dirs(config).items()]


async def episode(config: dict, task_id: str, base_url: str, api_key: str) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))  # harbor imports our plug-ins by import_path
    from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig, TrialConfig
    from harbor.trial.trial import Trial

    agent = config.get("agent") or f"{PLUGINS}:ProxyShellAgent"
    agent_cfg = AgentConfig(import_path=agent, model_name="policy") if ":" in agent else AgentConfig(name=agent)
    agent_cfg.env = {"MILES_PROXY_BASE_URL": base_url, "MILES_PROXY_API_KEY": api_key,
                     "MILES_PROXY_MAX_TURNS": str(config.get("max_turns", 3))}
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
    reward = float(rewards.get("reward", next(iter(rewards.values()), 0.0)))
    return {"reward": reward, "parts": {k: float(v) for k, v in rewards.items() if k != "reward"},
            "info": {"trial": str(trials_dir) if keep else "", "agent": agent}}
