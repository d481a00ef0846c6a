"""NeMo Gym adapter against the REAL nemo-gym package (0.4.0, Python 3.12, its own venv): a resources
server in the shape of NeMo Gym's session-state and multi-reward examples (tests/fixtures/nemo_gym/
tally) served by NeMo Gym's own SimpleResourcesServer app under uvicorn on 127.0.0.1, and a data/
folder as NeMo Gym ships one (example / train / validation datasets next to example_rollouts.jsonl).

Cold: the nemo-gym venv (~3-5 min, cached under $MILES_AGENT_CACHE); warm: seconds per test."""

from __future__ import annotations

import asyncio
import re
import subprocess
from pathlib import Path

import pytest

from miles_agent.build import build_env, check_choices
from miles_agent.config import load_config
from miles_agent.errors import UserError
from miles_agent.types import Status

pytest.importorskip("aiohttp")
pytest.importorskip("openai")

from miles_agent.envs.external.nemo_gym import NEMO_GYM_VENV  # noqa: E402
from tests.envs.adapter_helpers import tool_call  # noqa: E402
from tests.envs.test_adapter_nemo_gym import play_chat_tools  # noqa: E402

FIXTURES = Path(__file__).parents[1] / "fixtures" / "nemo_gym"
DATA = FIXTURES / "tally" / "data"


@pytest.fixture(scope="module")
def tally_url():
    """The real nemo-gym serving the tally server on a free loopback port (printed by serve.py)."""
    try:
        python = NEMO_GYM_VENV.ensure()
    except UserError as e:  # no Python 3.12 on this machine
        pytest.skip(str(e))
    proc = subprocess.Popen([str(python), str(FIXTURES / "serve.py"), str(FIXTURES), "tally.app:TallyServer"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = proc.stdout.readline().strip()
        assert port.isdigit(), proc.stderr.read()
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def env_for(url, *options):
    return build_env(load_config(overrides=["env.name=nemo-gym", f"env.tasks={DATA}",
                                            f"env.options.url={url}", *options]))


def test_a_data_folder_gives_splits_and_never_the_example_rollouts(tally_url):
    env = env_for(tally_url)
    assert len(env.tasks("train")) == 3 and len(env.tasks("eval")) == 1  # train.jsonl / validation.jsonl
    assert env.tasks("eval")[0].info["row"]["expected"] == 12
    example = env_for(tally_url, "env.options.split=example")
    assert [t.info["row"]["expected"] for t in example.tasks("train")] == [5, 11]
    assert all("response" not in t.info["row"] for t in example.tasks("train"))


@pytest.mark.parametrize(("replies", "reward", "parts"), [
    ([tool_call("add", count=4), tool_call("add", count=4), "The total is 8."], 1.0,
     {"state": 1.0, "answer": 1.0, "final_total": 8.0}),
    ([tool_call("add", count=4), "The total is 8."], 0.5, {"state": 0.0, "answer": 1.0, "final_total": 4.0}),
])
def test_real_server_scores_the_episode_with_components_and_extra_fields(tally_url, tokenizer, scripted,
                                                                        replies, reward, parts):
    env = env_for(tally_url)
    (traj,) = play_chat_tools(env, tokenizer, scripted(replies))
    assert traj.status is Status.COMPLETED, traj.metadata
    traj.validate()
    assert traj.reward == reward and traj.reward_parts == parts


def test_policy_oracle_replays_nemo_gyms_example_rollouts(tally_url):
    from miles_agent.evaluate import evaluate

    cfg = load_config("tiny-cpu", ["env.name=nemo-gym", f"env.tasks={DATA}", f"env.options.url={tally_url}",
                                   "env.options.split=example"])
    assert asyncio.run(evaluate(cfg, policy="oracle"))["reward_mean"] == 1.0
    train = load_config("tiny-cpu", ["env.name=nemo-gym", f"env.tasks={DATA}", f"env.options.url={tally_url}"])
    report = asyncio.run(evaluate(train, policy="oracle"))  # each task's row says why it has no oracle
    assert report.rows and all(re.search("no example_rollouts.*env.options.split=example", r["reason"] or "")
                               and r["reward"] is None for r in report.rows)


def test_an_ng_run_config_names_the_datasets(tally_url, tmp_path):
    config = tmp_path / "configs" / "tally.yaml"
    config.parent.mkdir()
    config.write_text(f"""tally_resources_server:
  resources_servers:
    tally:
      entrypoint: app.py
tally_simple_agent:
  responses_api_agents:
    simple_agent:
      datasets:
      - name: train
        type: train
        jsonl_fpath: {DATA}/train.jsonl
      - name: example
        type: example
        jsonl_fpath: {DATA}/example.jsonl
""")
    env = build_env(load_config(overrides=["env.name=nemo-gym", f"env.options.config={config}",
                                           f"env.options.url={tally_url}"]))
    assert len(env.tasks("train")) == 3
    with pytest.raises(UserError, match=r"env.options: splt not accepted .*did you mean 'split'"):
        check_choices(load_config("tiny-cpu", ["env.name=nemo-gym", "env.options.splt=x"]))
