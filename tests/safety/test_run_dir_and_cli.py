"""A new run never silently replaces an old one; the CLI explains the override rule and a full disk."""

from __future__ import annotations

import errno
import json

import pytest

from miles_agent import cli
from miles_agent.config import load_config
from miles_agent.errors import UserError
from miles_agent.run_state import check_resume, check_run_dir


def _old_run(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_2")
    (run / "final").mkdir()
    (run / "final" / "model.safetensors").write_bytes(b"weights")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0}) + "\n")
    return run


def test_a_new_run_into_a_finished_runs_folder_is_refused(tmp_path):
    run = _old_run(tmp_path)
    with pytest.raises(UserError, match="already holds a run .*--resume .*--overwrite .*another --run-dir"):
        check_run_dir(run, resume=False, overwrite=False)
    assert (run / "final" / "model.safetensors").read_bytes() == b"weights"
    check_run_dir(run, resume=True, overwrite=False)  # continuing it is fine
    check_run_dir(tmp_path / "fresh", resume=False, overwrite=False)


def test_overwrite_removes_the_old_checkpoints_so_a_later_resume_cannot_pick_them(tmp_path):
    run = _old_run(tmp_path)
    check_run_dir(run, resume=False, overwrite=True)
    assert not (run / "checkpoints").exists() and not (run / "final").exists()


def test_resume_of_a_run_stopped_before_its_first_checkpoint_starts_it_again(tmp_path, caplog):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text('{"step": 0}\n')  # logged, then killed before the checkpoint
    assert check_run_dir(run, resume=True, overwrite=False) is False and "no checkpoint yet" in caplog.text
    assert check_run_dir(_old_run(tmp_path / "b"), resume=True, overwrite=False) is True


def test_the_cli_refuses_before_loading_a_model(tmp_path, capsys):
    run = _old_run(tmp_path)
    code = cli.main(["train", "--env", "arith-tools", "--run-dir", str(run), "run.steps=2"])
    err = capsys.readouterr().err
    assert code == 2 and "--overwrite" in err and err.count("\n") == 1


def test_a_run_dir_that_is_a_file_or_under_one_is_one_line(tmp_path, capsys):
    (tmp_path / "notes").write_text("mine")
    with pytest.raises(UserError, match="notes is a file, not a folder"):
        check_run_dir(tmp_path / "notes", resume=False, overwrite=False)
    # a file part-way down the path: mkdir's NotADirectoryError, after the model loaded, used to be a traceback
    code = cli.main(["train", "--env", "arith-tools", "--run-dir", str(tmp_path / "notes" / "r"), "run.steps=1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and f"{tmp_path / 'notes'} is a file, not a folder" in err
    # other paths (a --job-dir, a report's --out): the OSError is one line naming it
    from miles_agent.cli import main

    code = main(["report", str(_old_run(tmp_path / "b")), "--out", str(tmp_path / "notes" / "page")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "Not a directory" in err and "pick another path" in err
    assert (tmp_path / "notes").read_text() == "mine"


def test_an_override_between_options_gets_the_rule_and_the_corrected_command(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--env", "arith-tools", "run.steps=2", "--seed", "3", "train.lr=1e-5", "--no-progress"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "go after all the options" in err
    assert "miles-agent train --env arith-tools --seed 3 --no-progress run.steps=2 train.lr=1e-5" in err


def test_a_true_typo_still_gets_argparse_s_own_answer(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--env", "arith-tools", "--stpes", "2"])
    assert "unrecognized arguments: --stpes" in capsys.readouterr().err


def test_resume_command_is_the_same_line_with_resume(tmp_path):
    args = cli.build_parser().parse_args(["train", "--env", "e", "--overwrite", "run.steps=3"])
    args.argv = ["train", "--env", "e", "--overwrite", "run.steps=3"]
    assert cli.resume_command(args) == "miles-agent train --resume --env e run.steps=3"


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_full_disk_says_space_and_where(monkeypatch, capsys, tmp_path, wrapped):
    def full(args, cfg):
        e = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "r" / "metrics.jsonl"))
        if wrapped:  # the trainer's checkpoint save: torch DCP wraps each rank's error (a BaseException)
            from torch.distributed.checkpoint.api import CheckpointException

            raise CheckpointException("save failed", {0: (e, None)})
        raise e

    monkeypatch.setattr(cli, "_train", full)
    code = cli.main(["train", "--env", "arith-tools", "--run-dir", str(tmp_path / "r"), "run.steps=1"])
    err = capsys.readouterr().err
    assert code == 28 and "no space left" in err and str(tmp_path / "r" / "metrics.jsonl") in err
    assert "--resume" in err and "Traceback" not in err


def test_resume_continues_the_same_run_or_says_there_is_nothing_to_do(tmp_path, capsys):
    run = _old_run(tmp_path)
    (run / "config.json").write_text(json.dumps({"env": {"name": "arith-tools"}, "model": {"arch": "tiny-qwen3"}}))
    (run / "checkpoints" / "step_2" / "loop_state.json").write_text(json.dumps({"step": 2}))
    (run / "checkpoints" / "latest").write_text("step_7")  # gone: the step that counts is the intact one
    assert check_resume(run, load_config(None, ["run.steps=3"])) == 2
    # another environment used to train on into the old run, replacing its final model
    code = cli.main(["train", "--env", "terminal-bench", "--run-dir", str(run), "--resume", "run.steps=3"])
    err = capsys.readouterr().err
    assert code == 2 and "is a run of env.name='arith-tools', not 'terminal-bench'; resume it with --env arith-tools" in err
    # all steps done: said, and nothing rewritten (it used to reload and rewrite the final model silently)
    code = cli.main(["train", "--env", "arith-tools", "--run-dir", str(run), "--resume", "run.steps=2"])
    assert code == 0 and "already ran 2 steps (run.steps=2): nothing to do" in capsys.readouterr().out
    assert (run / "final" / "model.safetensors").read_bytes() == b"weights"
