"""Trajectory.validate pins the TITO invariants; each broken invariant is named."""

from __future__ import annotations

import numpy as np
import pytest

from miles_agent.types import Status, Trajectory, TrajectoryError


def make() -> Trajectory:
    t = Trajectory(prompt_ids=[1, 2, 3], task_id="x")
    t.append_model([4, 5], [-0.1, -0.2], weight_version=0, turn=0)
    t.append_observation([6, 7, 8], turn=1)
    t.append_model([9], [-0.3], weight_version=1, turn=1)
    t.reward = 1.0
    return t


def test_valid_trajectory_round_trips():
    t = make().validate()
    assert t.tokens == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert t.loss_mask == [1, 1, 0, 0, 0, 1] and [x for x, m in zip(t.response_ids, t.loss_mask) if m] == [4, 5, 9]
    assert [s.weight_version for s in t.spans] == [0, None, 1]
    t.routed_experts = np.zeros((8, 2, 2), dtype=np.int32)
    u = Trajectory.from_dict(t.to_dict()).validate()
    assert u.to_dict() == t.to_dict()


def test_episode_id_defaults_to_uid_and_round_trips():
    t = make()
    assert t.episode_id == t.uid
    t.episode_id = "ep-7"
    assert Trajectory.from_dict(t.to_dict()).episode_id == "ep-7"


@pytest.mark.parametrize("breakage, message", [
    (lambda t: t.loss_mask.__setitem__(2, 1), "did not sample"),
    (lambda t: t.rollout_logprobs.pop(), "rollout_logprobs has"),
    (lambda t: t.rollout_logprobs.__setitem__(0, 0.5), "has logprob 0.5"),
    (lambda t: t.rollout_logprobs.__setitem__(3, -1.0), "observation token"),
    (lambda t: t.tokens.append(10), "loss_mask has"),
    (lambda t: setattr(t, "prompt_ids", [9, 9, 9]), "do not start with"),
    (lambda t: setattr(t, "reward", None), "must carry a reward"),
    (lambda t: setattr(t, "routed_experts", np.zeros((3, 2, 2), dtype=np.int32)), "routed_experts shape"),
    (lambda t: setattr(t.spans[2], "weight_version", None), "no weight_version"),
])
def test_each_broken_invariant_is_named(breakage, message):
    t = make()
    breakage(t)
    with pytest.raises(TrajectoryError, match=message):
        t.validate()


def test_aborted_needs_no_reward_and_untrainable_span_is_allowed():
    t = Trajectory(prompt_ids=[1])
    t.append_model([2, 3], [-1.0, -1.0], weight_version=0, turn=0, trainable=False)
    t.status = Status.ABORTED
    assert t.validate().loss_mask == [0, 0]


def test_a_turn_sampled_by_two_weight_versions_becomes_one_span_per_version():
    t = Trajectory(prompt_ids=[1])
    t.append_model([4, 5], [-0.1, -0.2], weight_version=0, turn=0, version_starts=[(0, 0)])
    t.append_model([6, 7, 8, 9], [-0.3] * 4, weight_version=2, turn=1, version_starts=[(1, 0), (2, 3)])
    t.reward = 0.0
    t.validate()
    assert [(s.start, s.end, s.weight_version) for s in t.spans] == [(0, 2, 0), (2, 5, 1), (5, 6, 2)]
    assert t.weight_versions == [0, 1, 2] and t.num_turns == 2
    assert Trajectory.from_dict(t.to_dict()).spans == t.spans
