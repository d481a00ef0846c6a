"""Careless input found by the held-out suite (issue #23): each is one line naming the cause and the fix,
before any model loads -- never a traceback, never a silent run of the wrong thing."""

from __future__ import annotations

import pytest

from miles_agent import cli
from miles_agent.environment import split_tasks
from miles_agent.errors import UserError


def test_an_unknown_split_is_one_line_naming_it(capsys, tmp_path):
    code = cli.main(["eval", "--env", "arith-tools", "--policy", "oracle", "--split", "bogus", "--limit", "2",
                     "--job-dir", str(tmp_path / "j")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1  # was a ValueError traceback
    assert "--split='bogus'" in err and "use train, eval, test or sft" in err


def test_eval_limit_below_one_is_refused_not_read_as_all(capsys, tmp_path):
    code = cli.main(["eval", "--env", "arith-tools", "--policy", "oracle", "--limit", "0",
                     "--job-dir", str(tmp_path / "j")])
    assert code == 2 and "--limit 0: evaluate at least 1 task" in capsys.readouterr().err  # ran all 256 before
    assert not (tmp_path / "j").exists()


def test_an_environment_with_no_tasks_in_a_split_says_so():
    from miles_agent.envs.arith_tools.env import ArithToolsEnv

    class Empty(ArithToolsEnv):
        name = "empty"

        def tasks(self, split="train"):
            return []

    with pytest.raises(UserError, match=r"'empty' has no tasks in its 'train' split; check where it reads them"):
        split_tasks(Empty(), "train", None)
    with pytest.raises(UserError, match=r"or set sft.split to a split that has some"):
        split_tasks(Empty(), "sft", "sft.split")

    class AllRefused(Empty):
        excluded = {"t": "needs its container"}

    assert split_tasks(AllRefused(), "all") == []  # eval then lists each refused task with its reason
