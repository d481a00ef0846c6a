"""SFT data: multi-turn TITO trajectories with their own masks; a bad file names the line and the fix."""

from __future__ import annotations

import json
import random

import pytest

from miles_agent.config import AlgoConfig, TrainConfig
from miles_agent.engine import SamplingParams
from miles_agent.environment import HarnessLimits
from miles_agent.errors import UserError
from miles_agent.sft import demonstrations, read_trajectories, sft_steps, write_trajectories
from miles_agent.types import SpanKind


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads; on shared cores they only add barrier waits."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def demos(tokenizer):
    from miles_agent.envs.arith_tools import ArithToolsEnv
    from miles_agent.harnesses.chat_tools import ChatToolsHarness

    harness = ChatToolsHarness(tokenizer, HarnessLimits(), SamplingParams(max_new_tokens=128))
    return demonstrations(ArithToolsEnv(), harness, tokenizer, tool_rate=1.0, limit=6)


def test_demonstrations_are_multi_turn_trajectories_masked_on_the_model_turns(demos, tokenizer):
    assert len(demos) == 6
    for t in demos:
        kinds = [s.kind for s in t.spans]
        # tool call, tool output (+ template markers), answer: the oracle's two turns
        assert kinds == [SpanKind.MODEL, SpanKind.OBSERVATION, SpanKind.MODEL]
        for s in t.spans:
            assert set(t.loss_mask[s.start:s.end]) == {1 if s.kind is SpanKind.MODEL else 0}
        answer = t.spans[2]
        assert tokenizer.decode(t.response_ids[answer.start:answer.end]).startswith("<answer>ans</answer>")


def test_jsonl_round_trip_keeps_tokens_and_masks(demos, tmp_path):
    path = write_trajectories(demos, tmp_path / "data.jsonl")
    back = read_trajectories(path, vocab_size=512)
    assert [(t.tokens, t.loss_mask, t.prompt_ids) for t in back] == \
        [(t.tokens, t.loss_mask, t.prompt_ids) for t in demos]
    assert len(read_trajectories(path, limit=2)) == 2


def bad_file(tmp_path, demos, line3: str) -> str:
    rows = [json.dumps(demos[0].to_dict()), "", line3]
    (tmp_path / "bad.jsonl").write_text("\n".join(rows) + "\n")
    return str(tmp_path / "bad.jsonl")


@pytest.mark.parametrize("edit,message", [
    (lambda d: "{not json", r"bad.jsonl line 3: not valid JSON .*one Trajectory.to_dict\(\) JSON object"),
    (lambda d: "[1, 2]", r"line 3: a list, not a trajectory object"),
    (lambda d: json.dumps({k: v for k, v in d.items() if k != "tokens"}),
     r"line 3: not a trajectory, key 'tokens' is missing"),
    (lambda d: json.dumps({**d, "loss_mask": d["loss_mask"][:-1]}),
     r"line 3: invalid trajectory: loss_mask has \d+ entries for \d+ response tokens; fix or drop the line"),
    (lambda d: json.dumps({**d, "tokens": d["tokens"][:-1] + [900]}),
     r"line 3: token id 900 is outside the model's vocabulary of 512"),
])
def test_a_bad_line_is_named_with_the_fix(tmp_path, demos, edit, message):
    path = bad_file(tmp_path, demos, edit(demos[1].to_dict()))
    with pytest.raises(UserError, match=message):
        read_trajectories(path, vocab_size=512)


def test_missing_or_untrainable_files_say_what_to_do(tmp_path, demos):
    with pytest.raises(UserError, match="nope.jsonl does not exist; point it at a JSONL file.*sft.data=demonstrator"):
        read_trajectories(tmp_path / "nope.jsonl")
    failed = {**demos[0].to_dict(), "status": "failed"}
    (tmp_path / "f.jsonl").write_text(json.dumps(failed) + "\n")
    with pytest.raises(UserError, match="holds no trainable trajectory"):
        read_trajectories(tmp_path / "f.jsonl")
    unscored = {**demos[0].to_dict(), "reward": None}  # converted chat data: SFT ignores rewards
    (tmp_path / "u.jsonl").write_text(json.dumps(unscored) + "\n")
    assert len(read_trajectories(tmp_path / "u.jsonl")) == 1


def test_sft_steps_train_exactly_the_masked_tokens_and_lower_the_loss(demos, tokenizer):

    from miles_agent.models.builder import build_tiny
    from miles_agent.trainers.fsdp2 import FSDP2Trainer

    model, _ = build_tiny("tiny-qwen3", seed=0)
    trainer = FSDP2Trainer(model, tokenizer, TrainConfig(lr=3e-3), AlgoConfig(loss="sft"))
    seen = []
    try:
        last = sft_steps(trainer, demos, 4, batch_size=len(demos), rng=random.Random(0), on_step=seen.append)
    finally:
        trainer.close()
    assert len(seen) == 4
    assert all(m["tokens"] == sum(sum(t.loss_mask) for t in demos) for m in seen)  # the whole set, masked
    assert last["loss"] < 0.85 * seen[0]["loss"]  # measured: 5.62 -> 4.44
