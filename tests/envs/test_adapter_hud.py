"""HUD adapter: the example HUD environment (a ``@env.template`` async generator) is served by HUD's
own LocalRuntime and played by HUD's OpenAI-compatible agent (``OpenAIChatAgent``) through the
proxy; the trajectory is what was sampled and the reward is HUD's grade of the run.

The hud venv is created on first use (cached under $MILES_AGENT_CACHE, ~2-4 min cold)."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_agent.build import build_env
from miles_agent.config import load_config
from miles_agent.envs.external.adapters import HudEnv
from miles_agent.types import Status
from tests.envs.adapter_helpers import model_texts, play

pytest.importorskip("aiohttp")


def letter_score(word: str, answer: str) -> float:  # the example template's rule, restated
    return len(set(word) & set(answer.lower())) / len(set(word))


def test_hud_scripted_episode_gets_the_template_reward(tokenizer, scripted):
    env = HudEnv()
    assert [t.id for t in env.tasks()] == ["0", "1", "2", "3"]
    assert env.tasks()[1].info == {"template": "spell", "args": {"word": "river"}}
    policy = scripted(["rev"])  # "river": r, e, v of its 4 distinct letters
    (traj,) = play(env, tokenizer, policy, task_index=1)
    assert traj.status is Status.COMPLETED, traj.metadata
    traj.validate()
    assert traj.reward == pytest.approx(0.75)
    assert traj.reward_parts == {"steps": 1.0}
    assert model_texts(traj, tokenizer) == ["rev"]
    assert traj.loss_mask.count(1) == len(policy.sampled[0])


def test_hud_tiny_model_episode_is_tito_and_graded_by_hud(tokenizer):
    from miles_agent.engines.embedded.engine import EmbeddedEngine
    from miles_agent.models.builder import build_tiny

    model, tok = build_tiny("tiny-qwen3")
    env = HudEnv()
    (traj,) = play(env, tok, EmbeddedEngine(model, tok), task_index=0, max_new_tokens=8)  # "apple"
    traj.validate()
    assert traj.status in (Status.COMPLETED, Status.TRUNCATED), traj.metadata
    (text,) = model_texts(traj, tok)
    assert traj.reward == pytest.approx(letter_score("apple", text))


def test_hud_tool_template_calls_the_env_mcp_tool_through_the_agent(tokenizer, scripted):
    from miles_agent.envs.external.adapters import ADAPTERS

    env = HudEnv(env_file=str(ADAPTERS / "examples" / "hud_tools" / "env.py"), max_steps=3, max_tokens=128,
                 tasks=[{"template": "count", "args": {"word": "banana", "letter": "a"}}])
    call = '<tool_call>{"name": "count_letter", "arguments": {"word": "banana", "letter": "a"}}</tool_call>'
    policy = scripted([call, "3"])
    (traj,) = play(env, tokenizer, policy, max_new_tokens=128)
    assert traj.status is Status.COMPLETED, traj.metadata
    traj.validate()
    assert model_texts(traj, tokenizer) == [call, "3"]
    assert traj.reward == 1.0 and traj.reward_parts == {"steps": 2.0}
    n = len(traj.prompt_ids)
    observation = tokenizer.decode([t for t, m in zip(traj.tokens[n:], traj.loss_mask, strict=True) if not m])
    assert "<tool_response>3</tool_response>" in observation  # the MCP tool's answer, back as a tool message


CAPITALS = Path(__file__).parents[1] / "fixtures" / "hud_envs" / "capitals" / "env.py"


@pytest.mark.parametrize(("reply", "reward"), [("Tokyo", 1.0), ("Kyoto", 0.0)])
def test_hud_env_runs_its_own_taskset_and_keeps_the_grade_info(tokenizer, scripted, reply, reward):
    env = build_env(load_config(overrides=["env.name=hud", f"env.options.env_file={CAPITALS}"]))
    assert [t.info["args"]["country"] for t in env.tasks()] == ["France", "Japan"]  # declared in env.py
    (traj,) = play(env, tokenizer, scripted([reply]), task_index=1)
    assert traj.status is Status.COMPLETED, traj.metadata
    assert traj.reward == reward
    assert traj.reward_parts == {"steps": 1.0, "info/exact": reward, "info/length": 5.0}  # EvaluationResult.info
