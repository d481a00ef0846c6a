"""NeMo Gym adapter against a resources server written to NeMo Gym's HTTP contract
(tests/envs/nemo_gym_contract.py): fast, no venv. The same adapter against the real nemo-gym package
is tests/envs/test_adapter_nemo_gym_real.py.

The server is started by each test on 127.0.0.1 in a thread; episodes run through the chat-tools
harness (exact TITO) with the row's tools, each call going to the server's tool route under the
session cookie that /seed_session set, and the reward is the server's /verify answer."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from miles_agent.engine import SamplingParams
from miles_agent.environment import HarnessLimits
from miles_agent.errors import UserError
from miles_agent.rollout.episodes import EpisodeRunner
from miles_agent.types import Status

pytest.importorskip("aiohttp")
pytest.importorskip("openai")

from aiohttp import web  # noqa: E402

from miles_agent.envs.external.nemo_gym import NemoGymEnv  # noqa: E402
from tests.envs.adapter_helpers import model_texts  # noqa: E402
from tests.envs.nemo_gym_contract import CounterServer, counter_row  # noqa: E402


@pytest.fixture
def server():
    """The contract server on 127.0.0.1 in its own thread and event loop; yields (CounterServer, url)."""
    gym, loop, ready = CounterServer(), asyncio.new_event_loop(), threading.Event()
    state = {}

    async def start():
        runner = web.AppRunner(gym.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        state["runner"], state["port"] = runner, site._server.sockets[0].getsockname()[1]
        ready.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    thread.start()
    assert ready.wait(10)
    yield gym, f"http://127.0.0.1:{state['port']}"
    asyncio.run_coroutine_threadsafe(state["runner"].cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.fixture
def tasks_file(tmp_path):
    path = tmp_path / "example.jsonl"
    rows = [counter_row("add 1 then add 2 then get the count", 3, 6),
            counter_row("add 4 then add 5 then get the count", 6, 15)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def play_chat_tools(env, tokenizer, policy, task_index=0, max_new_tokens=64):
    from miles_agent.harnesses.chat_tools import ChatToolsHarness

    task = env.tasks()[task_index]
    harness = ChatToolsHarness(tokenizer, HarnessLimits(max_turns=6, max_total_tokens=2048,
                                                        max_new_tokens_per_turn=max_new_tokens),
                               SamplingParams(max_new_tokens=max_new_tokens))
    return asyncio.run(EpisodeRunner(env, harness, max_retries=0).run(task, policy, group_id="g"))


def call(name, **args):
    return f'<tool_call>{{"name": "{name}", "arguments": {json.dumps(args)}}}</tool_call>'


def test_nemo_gym_tasks_are_the_rows_prompts_and_tools(server, tasks_file):
    _, url = server
    env = NemoGymEnv(url=url, tasks=str(tasks_file))
    (t0, t1) = env.tasks()
    assert t0.messages == ({"role": "user", "content": "add 1 then add 2 then get the count"},)
    assert t1.info["row"]["expected_count"] == 15
    assert NemoGymEnv(url=url, tasks_dir=str(tasks_file.parent)).tasks()[1].id == "1"
    with pytest.raises(UserError, match="NEMO_GYM_RESOURCES_URL"):
        NemoGymEnv(tasks=str(tasks_file))
    tasks_file.write_text('{"input": "x"}\n')
    with pytest.raises(UserError, match="responses_create_params"):
        NemoGymEnv(url=url, tasks=str(tasks_file)).tasks()


@pytest.mark.parametrize(("final", "reward", "answer"), [("The count is 6.", 1.0, 1.0), ("It is 5.", 0.5, 0.0)])
def test_nemo_gym_scripted_episode_uses_tool_routes_and_verify(server, tasks_file, tokenizer, scripted,
                                                               final, reward, answer):
    gym, url = server
    env = NemoGymEnv(url=url, tasks=str(tasks_file))
    replies = [call("increment_counter", count=1), call("increment_counter", count=2),
               call("get_counter_value"), final]
    policy = scripted(replies)
    (traj,) = play_chat_tools(env, tokenizer, policy, task_index=0)
    assert traj.status is Status.COMPLETED, traj.metadata
    traj.validate()
    # seeded at 3 (only if the seed's cookie reached the tool routes) + 1 + 2 = 6 = expected_count
    assert traj.reward == pytest.approx(reward)
    assert traj.reward_parts == {"count": 1.0, "answer": answer}
    assert model_texts(traj, tokenizer) == replies
    (session,) = {s for s, _, _ in gym.log}  # one cookie for seed, every tool call and verify
    assert [(route, body) for _, route, body in gym.log[1:4]] == [
        ("/increment_counter", {"count": 1}), ("/increment_counter", {"count": 2}), ("/get_counter_value", {})]
    (verified,) = gym.verified
    out = verified["request"]["response"]["output"]
    assert [o["type"] for o in out] == ["function_call", "function_call_output"] * 3 + ["message"]
    assert out[5]["output"] == '{"count": 6}' and out[-1]["content"][0]["text"] == final
    assert verified["request"]["expected_count"] == 6


def test_nemo_gym_unknown_tool_is_an_error_the_model_sees(server, tasks_file, tokenizer, scripted):
    gym, url = server
    env = NemoGymEnv(url=url, tasks=str(tasks_file))
    (traj,) = play_chat_tools(env, tokenizer, scripted([call("verify"), "done"]), task_index=1)
    assert traj.status is Status.COMPLETED
    assert [route for _, route, _ in gym.log] == ["/seed_session", "/verify"]  # the model never reached /verify
    assert traj.reward == 0.0 and traj.reward_parts == {"count": 0.0, "answer": 0.0}


def test_nemo_gym_tiny_model_episode_is_tito_and_verified(server, tasks_file):
    from miles_agent.engines.embedded.engine import EmbeddedEngine
    from miles_agent.models.builder import build_tiny

    gym, url = server
    model, tok = build_tiny("tiny-qwen3")
    env = NemoGymEnv(url=url, tasks=str(tasks_file))
    (traj,) = play_chat_tools(env, tok, EmbeddedEngine(model, tok), task_index=1, max_new_tokens=8)
    traj.validate()
    assert traj.status in (Status.COMPLETED, Status.TRUNCATED), traj.metadata
    (verified,) = gym.verified
    assert traj.reward == pytest.approx(verified["reward"])
    texts = [o["content"][0]["text"] for o in verified["request"]["response"]["output"] if o["type"] == "message"]
    assert texts == [t.strip() for t in model_texts(traj, tok) if t.strip()]
