"""The starter family (envs/terminal_bench/starter.py): generated Harbor tasks a tiny model learns on.

Why: the family is what `miles-agent train --env terminal-bench --recipe tiny-cpu` plays, so each of its
kinds must be solvable by its oracle and refused untouched, in the real local sandbox under its own
test.sh; the demonstrator (the warm start's SFT data) must solve what it acts on and fail when lazy; and
the build step must send a run that starts from the built-in warm start -- and only such a run -- to it.
"""

from __future__ import annotations

import asyncio

import pytest
from test_terminal_bench_local import episode

from miles_agent.build import build_env
from miles_agent.config import load_config
from miles_agent.envs.terminal_bench import TerminalBenchEnv, starter
from miles_agent.errors import UserError


@pytest.fixture(scope="module")
def env():
    return TerminalBenchEnv(family="starter")


def test_the_family_is_written_once_with_its_splits(env):
    root = starter.family_dir()
    assert (root / ".complete").is_file() and env.tasks_dir == root
    for split, size in starter.SPLIT_SIZES.items():
        tasks = env.tasks(split)
        assert len(tasks) == size and all(t.id.startswith(f"starter-{split}-") for t in tasks)
    assert {t.id.rsplit("-", 1)[1] for t in env.tasks("train")} == set(starter.KINDS)
    again = starter.split_tasks("eval")  # the same tasks on every machine and every call
    assert [(n, t.files) for n, t in again] == [(n, t.files) for n, t in starter.split_tasks("eval")]


def test_every_kind_oracle_scores_1_and_noop_scores_0(env):
    """Two tasks of each kind, from the eval split: solve.sh passes the kind's check, the start state fails it."""
    picked: dict[str, list] = {}
    for task in env.tasks("eval") + env.tasks("test"):
        picked.setdefault(task.id.rsplit("-", 1)[1], []).append(task)
    chosen = [t for kind in sorted(picked) for t in picked[kind][:2]]
    assert len(chosen) == 2 * len(starter.KINDS)

    async def main() -> list[str]:
        async def one(task) -> list[str]:
            solved, _ = await episode(env, task, oracle=True)
            untouched, _ = await episode(env, task)
            return [f"{task.id}: oracle {solved.value}, noop {untouched.value}"] if (solved.value, untouched.value) != (1.0, 0.0) else []
        return [line for lines in await asyncio.gather(*map(one, chosen)) for line in lines]

    assert asyncio.run(main()) == []


def test_a_wrong_command_fails_the_check(env):
    """The check reads the result, not that something ran: sorting into the wrong file, or reversing instead of
    sorting, scores 0."""
    task = next(t for t in env.tasks("eval") if t.id.endswith("-sort"))

    async def wrong(command):
        async def play(session, sandbox):
            await session.call_tool("bash", {"command": command})
        reward, _ = await episode(env, task, play)
        return reward.value

    assert asyncio.run(wrong("sort names.txt > sorted.txt")) == 1.0
    assert asyncio.run(wrong("sort names.txt > sort.txt")) == 0.0
    assert asyncio.run(wrong("tac names.txt > sorted.txt; sort -o names.txt names.txt")) == 0.0


def test_the_demonstrator_solves_when_it_acts_and_fails_when_lazy(env, tokenizer):
    from miles_agent.engine import SamplingParams
    from miles_agent.environment import HarnessLimits
    from miles_agent.harnesses.terminal import TerminalHarness
    from miles_agent.sandboxes.local import LocalSandbox
    from miles_agent.sft import demonstrations

    harness = TerminalHarness(tokenizer, HarnessLimits(), SamplingParams(max_new_tokens=128))
    for rate, reward in ((1.0, 1.0), (0.0, 0.0)):
        trajs = demonstrations(env, harness, tokenizer, split="eval", tool_rate=rate, limit=12,
                               make_sandbox=LocalSandbox)
        assert len(trajs) == 12 and {t.reward for t in trajs} == {reward}
        for t in trajs:
            t.validate()
            text = tokenizer.decode(t.tokens)  # the system message shows <bash> once
            assert text.count("<bash>") == (2 if rate else 1) and text.rstrip().endswith("Done.<|im_end|>")


def test_runs_from_the_builtin_warm_start_play_the_starter_family(tmp_path):
    assert build_env(load_config("tiny-cpu", {"env.name": "terminal-bench"})).family == "starter"
    # eval --policy oracle plays the tasks' solve.sh, no model: the hand-written tasks, as documented
    assert build_env(load_config("tiny-cpu", {"env.name": "terminal-bench"}), model_plays=False).family == "shipped"
    assert build_env(load_config(None, {"env.name": "terminal-bench"})).family == "shipped"  # no warm start
    explicit = load_config("tiny-cpu", {"env.name": "terminal-bench", "env.options.family": "shipped"})
    assert build_env(explicit).family == "shipped"
    from miles_agent.build import warm_start_options

    with_tasks = load_config("tiny-cpu", {"env.name": "terminal-bench", "env.tasks": str(tmp_path)})
    assert warm_start_options(with_tasks, TerminalBenchEnv) == {}  # a --tasks folder is played as given
    checkpoint = load_config("tiny-cpu", {"env.name": "terminal-bench", "model.hf_checkpoint": str(tmp_path)})
    assert warm_start_options(checkpoint, TerminalBenchEnv) == {}  # so is a run from a given model


def test_a_family_and_a_tasks_folder_together_are_refused(tmp_path):
    with pytest.raises(UserError, match="both name the tasks"):
        TerminalBenchEnv(tmp_path, family="starter")
    with pytest.raises(UserError, match="use shipped .* or starter"):
        TerminalBenchEnv(family="hard")


def test_the_warmstart_command_builds_from_the_family_in_the_sandbox(tmp_path, monkeypatch):
    """`miles-agent warmstart --env terminal-bench` (shortened: 2 SFT steps on 16 demonstrations) plays the
    starter family through the terminal harness in the local sandbox and writes a loadable HF folder."""
    from miles_agent import cli, sft
    from miles_agent.models.builder import load_hf

    monkeypatch.setattr(TerminalBenchEnv, "warm_start_stages", ((2, 1.0),))
    played = []
    full = sft.split_tasks

    def first_16(env, split, key):
        played.append((env.family, split))
        return full(env, split, key)[:16]

    monkeypatch.setattr(sft, "split_tasks", first_16)
    assert cli.main(["warmstart", "--env", "terminal-bench", "--out", str(tmp_path / "ws")]) == 0
    assert played == [("starter", "sft")]
    model, tokenizer = load_hf(tmp_path / "ws", "float32")
    assert model.config.vocab_size == len(tokenizer)
