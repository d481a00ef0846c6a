"""Every key that picks something is checked before any model loads (build.check_choices): a typo in
``sync.transport`` or ``run.sinks`` costs a second, not a model load or a Ray start."""

from __future__ import annotations

import pytest

from miles_agent.config import load_config
from miles_agent.errors import UserError
from miles_agent.loop import Run
from miles_agent.models import loading


@pytest.fixture
def no_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad choice was refused")

    monkeypatch.setattr(loading, "load_policy", refuse)


@pytest.mark.parametrize("override, message", [
    ("sync.transport=nccl", r"unknown weight transport 'nccl' \(sync.transport=nccl\)"),
    ("sync.transport=object-store", "needs cluster.mode=ray"),
    ("run.sinks=tensorbord", "run.sinks: unknown sink 'tensorbord'"),
    ("rollout.engine=vllm", r"unknown rollout engine 'vllm' \(rollout.engine=vllm\)"),
    ("cluster.mode=slurm", r"unknown cluster mode 'slurm' \(cluster.mode=slurm\)"),
    ("train.backend=deepspeed", r"unknown trainer 'deepspeed' \(train.backend=deepspeed\)"),
    ("env.harness=chat-tool", r"unknown harness 'chat-tool' \(env.harness=chat-tool\)"),
    ("algo.loss=ppo", "algo.loss"),
    ("algo.mismatch_correction=tiss", "mismatch"),
    ("train.offload=true", "train.offload=true frees"),
])
def test_a_bad_choice_fails_before_the_model_loads(no_model, tmp_path, override, message):
    with pytest.raises(UserError, match=message):
        Run(load_config("tiny-cpu", [override, f"run.run_dir={tmp_path}"]))


def test_ray_transport_choices_are_checked_before_ray_starts(no_model, tmp_path):
    with pytest.raises(UserError, match="sync.transport=disk is for cluster.mode=inprocess"):
        Run(load_config("tiny-cpu", ["cluster.mode=ray", "sync.transport=disk", f"run.run_dir={tmp_path}"]))
    with pytest.raises(UserError, match="cluster.colocate=false"):
        Run(load_config("tiny-cpu", ["cluster.mode=ray", "cluster.colocate=true", "sync.transport=distributed",
                                     f"run.run_dir={tmp_path}"]))
