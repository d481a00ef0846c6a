"""The dataset environment: rows from JSONL, Parquet or a saved HF dataset; exact, math-verify or a user
reward; tools by dotted path; every bad option refused before any model loads."""

from __future__ import annotations

import asyncio
import json

import pytest

from miles_agent.build import build_env, check_choices
from miles_agent.config import load_config
from miles_agent.engine import SamplingParams
from miles_agent.environment import HarnessLimits
from miles_agent.envs.dataset import DatasetEnv, extract_answer
from miles_agent.errors import UserError
from miles_agent.harnesses.chat_tools import ChatToolsHarness
from miles_agent.rollout.episodes import EpisodeRunner

ROWS = [{"question": f"What is {a} + {a}?", "answer": str(2 * a)} for a in range(10)]


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return str(path)


def play(env, tokenizer, scripted, replies, task_index=0, max_turns=1):
    harness = ChatToolsHarness(tokenizer, HarnessLimits(max_turns=max_turns, max_total_tokens=2048),
                               SamplingParams(max_new_tokens=96))
    task = env.tasks("train")[task_index]
    (t,) = asyncio.run(EpisodeRunner(env, harness, max_retries=0).run(task, scripted(replies), "g"))
    return t


def test_jsonl_rows_become_tasks_with_a_held_out_eval_split(jsonl):
    env = DatasetEnv(path=jsonl, prompt_field="question", eval_fraction=0.2, system_prompt="Be brief.")
    train, held = env.tasks("train"), env.tasks("eval")
    assert len(train) == 8 and len(held) == 2 and held[0].info["answer"] == "16"
    assert train[0].messages == ({"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "What is 0 + 0?"})
    assert env.tasks("test") == held


def test_parquet_and_a_saved_hf_dataset_load_the_same_rows(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "rows.parquet")
    from_parquet = DatasetEnv(path=str(tmp_path / "rows.parquet"), prompt_field="question", eval_fraction=0.0)
    assert [t.info["answer"] for t in from_parquet.tasks()] == [r["answer"] for r in ROWS]
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:7]),
                               "test": datasets.Dataset.from_list(ROWS[7:])})
    dd.save_to_disk(str(tmp_path / "saved"))
    env = DatasetEnv(path=str(tmp_path / "saved"), prompt_field="question", eval_split="test")
    assert len(env.tasks("train")) == 7 and [t.info["answer"] for t in env.tasks("eval")] == ["14", "16", "18"]
    with pytest.raises(UserError, match="has splits train, test, not 'validation'"):
        DatasetEnv(path=str(tmp_path / "saved"), prompt_field="question", split="validation")


def test_exact_match_reads_the_tagged_answer(jsonl, tokenizer, scripted):
    env = DatasetEnv(path=jsonl, prompt_field="question", eval_fraction=0.0)
    assert play(env, tokenizer, scripted, ["It is <answer>2</answer>."], task_index=1).reward == 1.0
    assert play(env, tokenizer, scripted, ["<answer>3</answer>"], task_index=1).reward == 0.0
    assert play(env, tokenizer, scripted, ["2"], task_index=1).reward == 1.0  # untagged: the whole reply
    assert extract_answer("so \\boxed{\\frac{1}{2}} it is") == ("\\frac{1}{2}", True)


def test_math_reward_accepts_equivalent_answers(tmp_path, tokenizer, scripted):
    path = tmp_path / "math.jsonl"
    path.write_text(json.dumps({"prompt": "Half of one?", "answer": "\\frac{1}{2}"}) + "\n")
    env = DatasetEnv(path=str(path), reward="math", eval_fraction=0.0)
    assert play(env, tokenizer, scripted, ["The answer is \\boxed{0.5}"]).reward == 1.0
    assert play(env, tokenizer, scripted, ["The answer is \\boxed{1/2}"]).reward == 1.0
    assert play(env, tokenizer, scripted, ["The answer is \\boxed{2}"]).reward == 0.0


def test_a_user_reward_and_user_tools_by_dotted_path(jsonl, user_module, tokenizer, scripted):
    user_module("ds_user", '''
        from miles_agent.environment import Reward

        def add(a: int, b: int):
            """Add two integers."""
            return a + b

        TOOLS = [add]

        def one(x):
            return 0.0

        async def judge(task, messages):
            used_tool = any(m["role"] == "tool" for m in messages)
            return Reward(1.0 if used_tool else 0.0, {"turn_reward/0": 0.5})
    ''')
    env = DatasetEnv(path=jsonl, prompt_field="question", reward="ds_user:judge", tools="ds_user:TOOLS")
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call>'
    t = play(env, tokenizer, scripted, [call, "<answer>4</answer>"], task_index=2, max_turns=2)
    assert t.reward == 1.0 and t.reward_parts["turn_reward/0"] == 0.5
    assert any(s.kind.value == "observation" for s in t.spans)  # the tool's reply is in the trajectory
    assert play(env, tokenizer, scripted, ["<answer>4</answer>"], task_index=2).reward == 0.0
    with pytest.raises(UserError, match=r"env.options.reward=ds_user:one: one\(x\) does not fit"):
        DatasetEnv(path=jsonl, prompt_field="question", reward="ds_user:one")


def test_bad_options_fail_before_any_model_loads(jsonl, tmp_path):
    def cfg(**options):
        return load_config("tiny-cpu", {"env.name": "dataset", **{f"env.options.{k}": v for k, v in options.items()}})

    with pytest.raises(UserError, match="did you mean 'path'"):
        check_choices(cfg(pathh=jsonl))
    for options, needle in [({}, "needs env.options.path"),
                            ({"path": str(tmp_path / "none.jsonl")}, "no such file"),
                            ({"path": jsonl}, "has no field 'prompt'"),
                            ({"path": jsonl, "prompt_field": "question", "reward": "fuzzy"}, "choose exact, math"),
                            ({"path": jsonl, "prompt_field": "question", "eval_fraction": 1.0}, "eval_fraction")]:
        with pytest.raises(UserError, match=needle):
            build_env(cfg(**options))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "b"}\nnot json\n')
    with pytest.raises(UserError, match="line 2 is not JSON"):
        build_env(cfg(path=str(bad)))
